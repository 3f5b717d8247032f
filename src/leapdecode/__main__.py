"""`python -m leapdecode ...` is the `leapdecode` command."""

import sys

from .cli import main

sys.exit(main())
