"""`python -m selfspec.cli ...`: the same as the `selfspec` command."""

import sys

from . import main

sys.exit(main())
