"""``python -m gradcomp.fusion``: see :mod:`gradcomp.fusion.cli`."""

import sys

from gradcomp.fusion.cli import main

if __name__ == "__main__":
  sys.exit(main())
