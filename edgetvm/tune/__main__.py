import sys

from edgetvm.tune.cli import main

sys.exit(main())
