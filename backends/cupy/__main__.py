"""Deprecated: ``python -m fusion_planner.backends.cupy`` (this alias is removed in release 0.3)."""

from fusion_planner.backends.cupy.__main__ import main

raise SystemExit(main())
