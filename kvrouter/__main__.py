"""`python -m kvrouter` is the `kvrouter` command."""

import sys

from kvrouter.cli import main

sys.exit(main())
