"""``python -m refresh``: the same as the ``refresh`` console script."""

from refresh.cli import main

raise SystemExit(main())
