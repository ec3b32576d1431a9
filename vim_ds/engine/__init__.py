"""The training engine: the run from its RunConfig (run.py), the trainer and the parts it is built from, the
optimizer and its schedule, the EMA, checkpointing, evaluation and metrics, the output folder and the preflight
checks. It reads the configuration (vim_ds/config/) and stands on the runtime (vim_ds/runtime/) and the libraries."""
