"""`python -m shardserve ...`: the same as the `shardserve` command."""

import sys

from shardserve.cli import main

sys.exit(main())
