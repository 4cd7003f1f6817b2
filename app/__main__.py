from ctxpatch.app.cli import main

raise SystemExit(main())
