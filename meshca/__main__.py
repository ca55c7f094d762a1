from meshca.cli import main

raise SystemExit(main())
