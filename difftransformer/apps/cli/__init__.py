"""`difftx`: the command-line interface (also `python -m difftransformer`), one module per command (or pair of
commands), the parser helpers they share in ``parsing``, and the entry point with every exit code in ``exits``.

Importing this package imports no torch: each command imports what it needs when it runs, so that a Ctrl-C during
start-up stops cleanly (exit 130) instead of ending in a traceback from inside an import.
"""

from difftransformer.apps.cli.exits import main
from difftransformer.apps.cli.parser import build_parser

__all__ = ["build_parser", "main"]
