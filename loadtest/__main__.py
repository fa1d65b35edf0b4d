"""``python -m loadtest …`` = the ``fairgate`` console script."""

from loadtest.cli import main

raise SystemExit(main())
