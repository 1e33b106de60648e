"""`python -m clipdist train|gradcheck|plan|bench|make-shards ...`"""

import sys

from clipdist.cli import main

sys.exit(main())
