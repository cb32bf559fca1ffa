"""``python -m ckptfs.testing.reliability``: the figures command (`.report.main`)."""

import sys

from ckptfs.testing.reliability.report import main

if __name__ == "__main__":
    sys.exit(main())
