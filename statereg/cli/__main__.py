"""`python -m statereg.cli`, the same as the `statereg` command."""

import sys

from statereg.cli.parser import main

sys.exit(main())
