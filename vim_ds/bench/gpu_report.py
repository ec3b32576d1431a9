"""`python -m vim_ds.bench.gpu_report` (tools/gpu_check.sh): vim_ds/cli/bench/gpu_report.py."""
import sys

from vim_ds.cli.bench.gpu_report import main

if __name__ == "__main__":
    sys.exit(main())
