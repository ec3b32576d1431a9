"""Test helper, one process (a world of one; launched as `torchrun --standalone --nproc_per_node=1 THIS ARGS`, which
the suite forks from its preloaded server): build the parts of the run that `vim-ds train ARGS` describes with the
builder functions of vim_ds.engine.parts, one by one, hand them to a Trainer (one TrainerParts, and the
LoopSettings of the options) and run it (no output-folder claim, no options.yaml: only the loop and its
checkpoints). tests/test_trainer_parts.py compares its checkpoint with the same run through `python -m vim_ds.train`.

usage: torchrun --standalone --nproc_per_node=1 tests/trainer_from_parts.py <vim-ds train arguments>"""
from __future__ import annotations

import sys


def main(argv) -> int:
    from vim_ds.cli.run_options import parse_args
    from vim_ds.config.components import model_config
    from vim_ds.config.run_config import RunConfig
    from vim_ds.engine import parts
    from vim_ds.engine.trainer import Trainer
    from vim_ds.runtime import distributed, faults, sequence_groups

    config = RunConfig.from_dict(vars(parse_args(argv)))
    dist_info = distributed.setup(config.run.local_rank, config.run.dist_timeout)
    hook = faults.for_rank(dist_info.rank)
    # the order of parts.build_trainer: data, config, resume plan, mixup, loaders, weights (seeded), engine, ...
    datasets = parts.build_datasets(config)
    model_cfg = model_config(config, datasets.num_classes)
    ds, lr = parts.build_ds_config(config, dist_info)
    resume_path = parts.plan_resume(config, dist_info, ds, model_cfg, datasets)
    mixup = parts.build_mixup(config, ds.batch, datasets.num_classes)
    data = parts.build_data(config, dist_info, datasets, ds.batch, hook)
    model, described = parts.build_model(config, dist_info, model_cfg, datasets, ds)
    engine = parts.build_engine(config, dist_info, model, ds, data.steps_per_epoch)
    ema = parts.build_ema(config, engine.engine)
    run_parts = parts.TrainerParts(
        dist=dist_info, data=data, ds=ds, lr=lr, model=described, engine=engine, mixup=mixup,
        criterion=parts.build_criterion(config.augment.smoothing, mixup), ema=ema,
        checkpointer=parts.build_checkpointer(config, dist_info, engine, hook, ema),
        groups=sequence_groups.build(1, dist_info.rank, dist_info.world_size),
        record=parts.run_record(config, dist_info, ds, model_cfg, datasets), run_id=parts.new_run_id(),
        resume_path=resume_path, fault_hook=hook)
    trainer = Trainer(parts.loop_settings(config), run_parts)
    try:
        if resume_path:
            trainer.resume(resume_path)
        trainer.fit()
        progress = trainer.state.progress
        print(f"trained to step {progress.step}: {progress.last_checkpoint}", flush=True)
    finally:
        trainer.close()
        distributed.teardown()
    return 0


if __name__ == "__main__":
    from vim_ds.runtime import distributed

    distributed.end_rank_process(main(sys.argv[1:]))
