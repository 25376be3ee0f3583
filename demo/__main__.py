from demo.cli import main

raise SystemExit(main())
