"""Test helper, run as one plain process: build the DeepSpeed engine through vim_ds.engine.parts.build_trainer, run
one forward/backward, and print as JSON what `vim_ds.engine.memory.state_bytes` reads from the engine with the
gradients live (after backward) and after `engine.step()` has freed them, with the model's parameter count.

usage: python tests/engine_state_bytes.py <vim-ds train arguments>"""
from __future__ import annotations

import json
import sys

import torch


def main(argv):
    from vim_ds.cli.run_options import parse_args
    from vim_ds.config.run_config import RunConfig
    from vim_ds.engine.memory import state_bytes
    from vim_ds.engine.parts import build_trainer
    from vim_ds.runtime import distributed

    config = RunConfig.from_dict(vars(parse_args(argv)))
    trainer = build_trainer(config, distributed.setup(config.run.local_rank))
    engine = trainer.engine
    images, targets, _ = next(iter(trainer.parts.data.train_loader))
    loss = torch.nn.functional.cross_entropy(engine(images.to(trainer.parts.engine.dtype)).float(), targets)
    engine.backward(loss)
    live = state_bytes(engine)
    engine.step()
    after = state_bytes(engine)
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    print(json.dumps({"params": params, "live": live, "after_step": after}))
    distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
