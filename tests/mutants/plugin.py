"""A pytest plugin (`-p tests.mutants.plugin`) that runs the session against one planted bug: the module named by
MUTANT_MODULE is loaded from its own file with MUTANT_OLD replaced by MUTANT_NEW (exactly once), through an import
hook installed before anything imports it. Only this process sees the mutant (not worker ranks it starts)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, module: str, old: str, new: str) -> None:
        self.module, self.old, self.new = module, old, new

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)  # the real spec (its file) from the finders after this one
        try:
            real = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        self.origin = real.origin
        return importlib.util.spec_from_file_location(fullname, real.origin, loader=self)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        with open(self.origin) as f:
            source = f.read()
        count = source.count(self.old)
        if count != 1:
            raise RuntimeError(f"the mutant's text occurs {count} times in {self.origin}, not once: update it")
        exec(compile(source.replace(self.old, self.new), self.origin, "exec"), module.__dict__)


_module = os.environ.get("MUTANT_MODULE")
if _module:
    if _module in sys.modules:
        raise RuntimeError(f"{_module} was imported before the mutant plugin")
    sys.meta_path.insert(0, _MutantFinder(_module, os.environ["MUTANT_OLD"], os.environ["MUTANT_NEW"]))
