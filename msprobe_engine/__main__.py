"""``python -m msprobe_engine <verb>``."""
import sys

from msprobe_engine.cli import main

sys.exit(main())
