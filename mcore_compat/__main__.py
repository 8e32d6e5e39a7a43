import sys

from mcore_compat.cli import main

sys.exit(main())
