"""``python -m ckptfs``: the ``ckptfs`` command."""

import sys

from ckptfs.cli import main

sys.exit(main())
