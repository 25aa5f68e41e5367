"""``python -m kernels_core``: the ``kernels-core`` command line, for environments without the script on PATH."""

import sys

from ._cli import main


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
