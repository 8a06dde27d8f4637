import sys

from kvstore.daemon.cli import main

sys.exit(main())
