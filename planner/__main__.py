from planner.cli import main

raise SystemExit(main())
