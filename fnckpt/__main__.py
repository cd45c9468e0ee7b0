"""``python -m fnckpt ...``: the same as the ``fnckpt`` command (see :mod:`fnckpt.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
  sys.exit(main())
