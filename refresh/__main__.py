"""``python -m refresh``: the same as the ``refresh`` console script."""

from refresh.cli import main

__all__: list[str] = []

raise SystemExit(main())
