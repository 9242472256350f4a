"""shardserve.kernels: the Triton, torch and C kernels (the folder `kernels/` of the repository).

Wherever the repository's root is on sys.path (pytest's `pythonpath`, `python -m ...` run in a checkout) this folder
is also importable as a top-level `kernels`, and there it would hide the Hugging Face `kernels` package, which
transformers (>= 5.25) depends on and imports. Imported under that name, this module loads that package in its
place; where no other `kernels` is installed it stays an empty module, as before.
"""

if __name__ == "kernels":

    def _hand_over_the_name() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        here = os.path.realpath(__file__)
        root = os.path.dirname(os.path.dirname(here))
        elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
        if spec is None or spec.loader is None or os.path.realpath(spec.origin or "") == here:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # the import system returns what sys.modules holds once this body ends
        spec.loader.exec_module(module)

    _hand_over_the_name()
