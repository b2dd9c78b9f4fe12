"""`python -m statereg`: the `statereg` command, for environments without the console script."""

import sys

from statereg.cli import main

sys.exit(main())
