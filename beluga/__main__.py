"""``python -m beluga`` is the ``beluga`` command."""

import sys

from beluga.cli import main

sys.exit(main())
