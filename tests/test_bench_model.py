"""`vim-ds bench model`: each measurement runs in a fresh interpreter; the compiled rows really go through
torch.compile (inductor), which the child reports as the number of graphs dynamo produced."""
from __future__ import annotations

import pytest

from vim_ds.cli.bench import model as bench_model

TINY = dict(mode="train", batch=2, img_size=32, device="cpu", dtype="float32", warmup=2, repeat=1,
            model_kwargs=dict(depth=2, embed_dim=32, patch_size=4, stride=4))


@pytest.mark.slow
def test_eager_and_compiled_rows_from_fresh_processes():
    eager = bench_model.measure(dict(TINY, model="vim_tiny", compiled=False))
    compiled = bench_model.measure(dict(TINY, model="vim_tiny", compiled=True))
    for r in (eager, compiled):
        assert "error" not in r, r.get("error")
        assert r["seconds"] > 0 and r["peak_mem_bytes"] > 0
    assert "graphs" not in eager  # eager: dynamo never ran
    # One graph for the model's forward (its backward is compiled with it): Vim has no graph break.
    assert compiled["graphs"] >= 1 and compiled["graph_breaks"] == 0, compiled
    row = bench_model._model_row(compiled)
    assert "train compiled" in row and "0 graph breaks" in row


def test_a_failing_measurement_is_a_row_with_its_cause():
    r = bench_model.measure(dict(TINY, model="no_such_model", compiled=False))
    # the model description's message (models.ModelConfig.build), as `vim-ds train --model` says it
    assert "unknown model 'no_such_model'" in r["error"] and "FAILED" in bench_model._model_row(r)
