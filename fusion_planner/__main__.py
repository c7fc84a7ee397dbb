from fusion_planner.cli import main

raise SystemExit(main())
