"""`python -m loadgen` (from the repository root) and `python -m academus.loadgen`."""

from academus.loadgen.cli import main

raise SystemExit(main())
