"""The process and cluster runtime every layer above stands on: the process group and its ranks
(distributed, sequence_groups), the training backends a run's engine is built from (DeepSpeed's, the PyTorch DDP and
FSDP2 baselines), signals and the launcher's watch, ports, build tools and CUDA arch lists for DeepSpeed's JIT ops,
VIM_DS_* variables and fault injection, the write journal, launched training runs, version checks, and the one-line
error report. It imports no configuration, engine or command module (tests/test_layering.py)."""
