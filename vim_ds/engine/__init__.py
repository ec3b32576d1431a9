"""The training engine: DeepSpeed config, optimizer, EMA, checkpoints, metrics, trainer."""
