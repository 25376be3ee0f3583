from refstream.demo.cli import main

raise SystemExit(main())
