import sys

from autosync.cli import main

sys.exit(main())
