"""Test helper, launched like training (torchrun, any rank count): build the DeepSpeed engine through
vim_ds.engine.parts.build_trainer, restore a checkpoint with DeepSpeed's own load_checkpoint (--resume), and write the
logits of a fixed batch (torch.manual_seed(0), 4 random 3 x input_size^2 images) to $LOGITS_OUT from rank 0.

usage: torchrun ... tests/engine_logits.py <vim-ds train arguments, with --resume CKPT_DIR>"""
from __future__ import annotations

import os
import sys

import torch


def main(argv):
    from vim_ds.cli.run_options import parse_args
    from vim_ds.config.run_config import RunConfig
    from vim_ds.engine.parts import build_trainer
    from vim_ds.runtime import distributed

    config = RunConfig.from_dict(vars(parse_args(argv)))
    dist_info = distributed.setup(config.run.local_rank)
    trainer = build_trainer(config, dist_info)
    trainer.resume(config.run.resume)
    torch.manual_seed(0)
    size = config.model.input_size
    x = torch.randn(4, 3, size, size)
    trainer.engine.module.eval()
    with torch.no_grad():
        logits = trainer.engine(x.to(dist_info.device)).float().cpu()  # every rank: ZeRO-3 gathers collectively
    if dist_info.is_main:
        torch.save(logits, os.environ["LOGITS_OUT"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
