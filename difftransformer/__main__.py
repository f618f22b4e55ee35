import sys

from difftransformer.apps.cli import main

sys.exit(main())
