"""Deprecated: ``python -m fusion_planner`` is ``python -m planner`` (this alias is removed in release 0.3)."""

from planner.cli import main

raise SystemExit(main())
