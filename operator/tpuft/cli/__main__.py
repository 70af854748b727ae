"""`python -m tpuft.cli`: the `tpuft` command."""
import sys

from tpuft.cli import main

if __name__ == "__main__":   # not when a test imports every module
    sys.exit(main())
