"""``python -m sparse_eval.verdicts``: see ``sparse_eval.verdicts.evaluate``."""

import sys

from .evaluate import main

sys.exit(main())
