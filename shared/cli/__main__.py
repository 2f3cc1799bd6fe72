"""`python -m academus.shared.cli`: the `academus` command."""
import sys

from academus.shared.cli.main import main

sys.exit(main())
