"""``python -m fairgate …`` = the ``fairgate`` console script."""

from fairgate.cli import main

raise SystemExit(main())
