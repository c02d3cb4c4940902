import sys

from actcache.cli import main

sys.exit(main())
