"""``python -m enrich run --config conf/enrich.yaml``."""

from __future__ import annotations

import sys

from enrich.cli import main

if __name__ == "__main__":
    sys.exit(main())
