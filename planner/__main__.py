"""``python -m planner``: the ``fusion-planner`` command line."""

from planner.cli import main

raise SystemExit(main())
