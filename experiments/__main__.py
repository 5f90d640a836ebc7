"""``python -m experiments``: the digits demo (see experiments/digits.py)."""

import sys

from experiments.digits import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
