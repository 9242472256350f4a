"""`python -m shardserve ...`: the same as the `shardserve` command."""

import sys

from shardserve.cli.main import main

sys.exit(main())
