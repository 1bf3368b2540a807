"""``python -m albatross.cli``: the ``albatross`` command."""

import sys

from albatross.cli import main

sys.exit(main())
