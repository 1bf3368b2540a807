"""``python -m albatross.cli``: the ``albatross`` command."""

import sys

from albatross.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports the parent's main module
    sys.exit(main())
