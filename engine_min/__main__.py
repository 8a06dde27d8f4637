"""``python -m engine_min ...`` (see engine_min.cli)."""
import sys

from engine_min.cli import main

sys.exit(main())
