"""`python -m vim_ds.bench ...` and `python -m vim_ds.bench.gpu_report`, the paths scripts and docs use: the bench
command is vim_ds/cli/bench/."""
