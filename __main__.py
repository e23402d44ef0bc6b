"""``python -m kvpush``: the ``kvpush`` command (``plugins``, ``demo``, ``bench``)."""

from __future__ import annotations

import sys

from kvpush.cli import main

if __name__ == "__main__":
    sys.exit(main())
