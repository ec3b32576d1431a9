"""Test helper, one process (a world of one; launched as `torchrun --standalone --nproc_per_node=1 THIS OUT`, which the
suite forks from its preloaded server): a run's `TrainState` through a real `Checkpointer` and a real DeepSpeed
engine (ZeRO-0, a two-layer model): one step, save it into OUT/checkpoints, then restore it into a second engine and
checkpointer built from other weights, as a resumed run does. Prints one line `RESULT {json}` for
tests/test_trainer_parts.py.

usage: torchrun --standalone --nproc_per_node=1 tests/train_state_roundtrip.py OUT"""
from __future__ import annotations

import dataclasses
import json
import os
import sys


def main(out: str) -> int:
    import deepspeed
    import torch

    from vim_ds.checkpoint.convert import client_state
    from vim_ds.checkpoint.files import CheckpointError
    from vim_ds.config.ds_config import BatchSizes
    from vim_ds.config.run_config import RunConfig
    from vim_ds.engine.checkpointing import Checkpointer
    from vim_ds.engine.ema import ShardedEMA
    from vim_ds.engine.train_state import Progress, RunRecord, TrainState
    from vim_ds.models import ModelConfig
    from vim_ds.runtime import distributed

    distributed.setup(0)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}

    def engine_and_checkpointer(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        ema = ShardedEMA(engine.module, 0.5)
        return engine, ema, Checkpointer(engine, os.path.join(out, "checkpoints"), 0, keep_last=2, ema=ema)

    description = ModelConfig("vim_tiny", 2, 32, {"depth": 2}).description()
    record = RunRecord(world_size=1, batch=BatchSizes(2, 1, 1), precision="fp32", zero_stage=0,
                       model=description, classes=["a", "b"], args=RunConfig().to_dict())
    engine, ema, checkpointer = engine_and_checkpointer(0)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    ema.update()
    state = TrainState(record, "lineage1", Progress(epoch=1, step=7, step_in_epoch=3, images_seen=56.0,
                                                    images_bad=1.0, best_acc1=42.5, evaluation_owed=1))
    path = checkpointer.save(state)
    saved_weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    saved_ema = ema.full_state_dict()

    engine2, ema2, checkpointer2 = engine_and_checkpointer(1)
    fresh = TrainState(record, "new-run")
    restored = checkpointer2.restore(path, fresh)
    other_batch = TrainState(dataclasses.replace(record, batch=BatchSizes(4, 1, 1)), "other")
    try:
        checkpointer2.restore(path, other_batch)
        refusal = None
    except CheckpointError as exc:
        refusal = str(exc)
    result = {
        "path": path, "same_client_state": restored.client_state() == state.client_state(),
        "client_state_keys": list(restored.client_state()), "saved_keys": list(state.client_state()),
        # as the file holds them, after DeepSpeed's own
        "keys_on_disk": [k for k in client_state(path) if k in state.client_state()], "run_id": restored.run_id,
        "last_checkpoint": restored.progress.last_checkpoint, "fresh_untouched": fresh.progress == Progress(),
        "weights": all(torch.equal(v, saved_weights[k]) for k, v in engine2.module.state_dict().items()),
        "ema": all(torch.equal(v, saved_ema[k]) for k, v in ema2.full_state_dict().items()),
        "protected": checkpointer2.resumed_from, "refusal": refusal}
    print("RESULT " + json.dumps(result), flush=True)
    distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
