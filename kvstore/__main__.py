import sys

from kvstore.daemon.entry import main

sys.exit(main())
