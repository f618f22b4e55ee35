import sys

from difftransformer.cli import main

sys.exit(main())
