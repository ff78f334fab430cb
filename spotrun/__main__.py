"""``python -m spotrun`` runs the command line (see :mod:`spotrun.cli`)."""

from spotrun.cli import main

raise SystemExit(main())
