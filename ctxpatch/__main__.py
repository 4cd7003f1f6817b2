"""``python -m ctxpatch``: the command line (and, without a command, the window)."""

from ctxpatch.app.cli import main

raise SystemExit(main())
