import sys

from edgetvm.build.cli import main

sys.exit(main())
