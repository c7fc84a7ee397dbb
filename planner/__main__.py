"""Deprecated: ``python -m fusion_planner`` (this alias is removed in release 0.3)."""

from fusion_planner.cli import main

raise SystemExit(main())
