"""A refused run leaves the output folder as it found it (issue 36, item 8): an oversized --batch-size, refused by
the trainer after the folder was claimed, left an empty run folder and its lock; a DeepSpeed config refused before
the process group left an empty `checkpoints/` (the writability probe made it). One mechanism: the checks before
the process group create nothing, and what the claim created is removed when the run ends before it wrote
anything (vim_ds/engine/output_dir.py). A folder that existed before keeps what it held, and only that. Real runs
of the trainer (one rank), real folders."""
from __future__ import annotations

import json
import os

import pytest

from faults.test_one_line_causes import only_error_line
from train_utils import QUIET_AUG, TINY, config, run_train


def args(out, *extra) -> list:
    return ["--data-set", "synthetic", "--synthetic-size", 32, "--nb-classes", 4, *TINY, *QUIET_AUG,
            "--num_workers", 0, "--deepspeed_config", config("zero0"), "--precision", "fp32", "--lr", 2e-3,
            "--unscale-lr", "--warmup-epochs", 0, "--no-model-ema", "--max-steps", 1, "--output_dir", out, *extra]


def listing(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, dirs, files in os.walk(folder) for name in dirs + files)


CASES = {  # case: (extra arguments, the error's words)
    "oversized batch": (["--batch-size", 64], "the training set has 32 images, fewer than one global batch of 64"),
    "odd batch with Mixup": (["--batch-size", 3, "--mixup", 0.8], "Mixup/CutMix mix pairs within a micro batch"),
    "DeepSpeed config content": (["--batch-size", 4], "unknown top-level key"),  # refused before the process group
}


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "existing folder"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_run_leaves_the_output_folder_as_it_found_it(tmp_path, case, existing):
    extra, words = CASES[case]
    if case == "DeepSpeed config content":
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**json.load(open(config("zero0"))), "zero_optimisation": {}}))
        extra = [*extra, "--deepspeed_config", bad]
    if existing:  # the user's folder, with a file of theirs: it stays, and nothing is added
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:  # a new folder two levels down: neither level is left behind
        out = tmp_path / "runs" / "new"
    proc = run_train(args(out, *extra), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert words in only_error_line(proc)
    if existing:
        assert listing(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    else:
        assert not (tmp_path / "runs").exists(), listing(tmp_path / "runs")
