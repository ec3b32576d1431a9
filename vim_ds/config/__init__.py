"""A run's configuration: the typed RunConfig and its options (run_config), the rules between them (run_rules), the
option files and recipes (options_file, shipped_configs), the DeepSpeed JSON config (ds_config), the training
engines --engine chooses from (training_engines), and the data and model configs a RunConfig gives (components).
No argparse here (that is the command line's, vim_ds/cli/), and no engine module (tests/test_layering.py)."""
