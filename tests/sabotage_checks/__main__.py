"""``python -m tests.sabotage_checks [CHECK ...]``: run checks, one JSON line each."""

import sys

from tests.sabotage_checks import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
