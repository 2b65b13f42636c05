"""`python -m train`: see train/cli.py for the flags."""

import sys

from .cli import main

if __name__ == "__main__":
  sys.exit(main())
