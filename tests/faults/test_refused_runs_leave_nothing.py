"""A refused run leaves the output folder as it found it (issue 36, item 8): an oversized --batch-size, refused by
the trainer after the folder was claimed, left an empty run folder and its lock; a DeepSpeed config refused before
the process group left an empty `checkpoints/` (the writability probe made it). One mechanism: the checks before
the process group create nothing, and what the claim created is removed when the run ends before it wrote
anything (vim_ds/engine/output_dir.py). A folder that existed before keeps what it held, and only that. Real runs
of the trainer (one rank), real folders.

Issue 50, item 10: a run refused later, once it had written its options.yaml and metrics.jsonl (--sequence-parallel
4 over 2 tokens, refused at the first forward), left both, and a later run into the folder showed the refused run's
header in compare-runs. Whatever the run writes until its first step goes into its write journal
(vim_ds/runtime/write_journal.py) and is taken back when it ends in an error before then: files it made removed,
files it rewrote or appended to given back their bytes, whatever refused it."""
from __future__ import annotations

import json
import os

import pytest
import yaml

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


# -- issue 50, item 10: refused (or failed) after it wrote its records, before its first step ------------------------

def earlier_run(folder) -> dict:
    """A folder as an earlier run left it (its records, no checkpoint: a run without saves), with a file of the
    user's; returns every file's bytes."""
    folder.mkdir(parents=True)
    (folder / "options.yaml").write_text("# vim-ds train: this run's effective options\nlr: 0.001\nseed: 7\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"header": True, "world_size": 1, "input_size": 32}) + "\n"
                                          + json.dumps({"step": 1, "epoch": 0, "loss": 2.0, "lr": 0.001}) + "\n")
    (folder / "notes.txt").write_text("mine")
    return contents(folder)


def contents(folder) -> dict:
    return {name: (folder / name).read_bytes() for name in listing(folder)
            if (folder / name).is_file()} | {name: None for name in listing(folder) if (folder / name).is_dir()}


LATE = {  # case: (VIM_DS_INJECT, extra arguments, exit code, the error's words)
    # the issue's: a check that refuses the input at the first step, after options.yaml and metrics.jsonl exist
    "refused at the first step": ("refuse_in_step@1", [], 2, "a refusal injected at the start of step 1"),
    # the variant: not a refusal but a failure (exit 1) before any step was applied: the same journal
    "failed at the first step": ("nan_loss@1", ["--max-bad-steps", 1], 1,
                                 "loss is nan at step 1 (epoch 0), 1 consecutive bad step(s)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LATE))
def test_a_run_ending_in_an_error_before_its_first_step_takes_back_what_it_wrote(tmp_path, case):
    """An earlier run's folder, a run refused at its first step into it: options.yaml (rewritten by the run) and
    metrics.jsonl (appended to) hold exactly their earlier bytes, the lock, `checkpoints/` and the run's
    --save-init-weights file are gone, the user's file stays; the variant fails at its first step into a new
    folder two levels down, and neither level stays."""
    inject, extra, code, words = LATE[case]
    init = tmp_path / "init.pth"
    if case == "refused at the first step":
        out = tmp_path / "earlier"
        before = earlier_run(out)
    else:
        out = tmp_path / "runs" / "new"
    proc = run_train(args(out, "--batch-size", 4, "--save-init-weights", init, *extra), check=False,
                     env={"VIM_DS_INJECT": inject})
    assert proc.returncode == code, proc.stderr[-3000:]
    assert words in only_error_line(proc)
    assert "training vim_tiny" in proc.stdout  # it got as far as the training loop
    assert not init.exists()
    if case == "refused at the first step":
        assert contents(out) == before, listing(out)
        assert yaml.safe_load((out / "options.yaml").read_text()) == {"lr": 0.001, "seed": 7}
    else:
        assert not (tmp_path / "runs").exists(), listing(tmp_path / "runs")


def test_the_journal_gives_back_what_was_rewritten_appended_filled_or_created(tmp_path):
    """The mechanism, in-process: each kind of write taken back; nothing taken back once the run is sure (its first
    step), nor a folder someone else wrote into."""
    from vim_ds.runtime import write_journal

    def writes():
        write_journal.start()
        (tmp_path / "made").mkdir(exist_ok=True)
        write_journal.created(tmp_path / "made")
        write_journal.rewriting(tmp_path / "options.yaml")
        write_journal.rewriting(tmp_path / "options.yaml")  # the first note holds the state before the run
        (tmp_path / "options.yaml").write_text("the run's")
        write_journal.appending(tmp_path / "metrics.jsonl")
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write("the run's line\n")
        write_journal.filling(tmp_path / "tensorboard")
        (tmp_path / "tensorboard" / "events.2").write_text("the run's")
        write_journal.rewriting(tmp_path / "init.pth")
        (tmp_path / "init.pth").write_text("the run's")

    (tmp_path / "options.yaml").write_text("earlier")
    (tmp_path / "metrics.jsonl").write_text("earlier line\n")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.1").write_text("earlier")
    before = contents(tmp_path)
    writes()
    write_journal.undo()
    assert contents(tmp_path) == before
    writes()
    (tmp_path / "made" / "theirs.txt").write_text("someone else's")
    write_journal.undo()
    assert contents(tmp_path) == {**before, "made": None, "made/theirs.txt": b"someone else's"}
    os.remove(tmp_path / "made" / "theirs.txt")
    writes()
    write_journal.sure()
    write_journal.undo()
    assert (tmp_path / "options.yaml").read_text() == "the run's" and (tmp_path / "init.pth").exists()
    write_journal.start()  # as a run in this process would find it
