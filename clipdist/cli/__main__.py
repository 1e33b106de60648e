"""`python -m clipdist.cli ...`: the same as `clipdist ...`."""

import sys

from clipdist.cli import main

sys.exit(main())
