"""What vim_ds removes is what it wrote, and a live run's folder is said to be one before any advice (issue 50).

- Pruning (`--keep-checkpoints`) and every clean-up of a checkpoint folder remove the files the save wrote (the
  ones its marker lists; for an interrupted save, the files named as DeepSpeed and vim_ds name theirs), and the
  folder only when nothing else is left in it; only folders named as the run names them (`global_stepN`, whose
  marker says step N) are the run's (vim_ds/checkpoint/deepspeed_dir.py `remove_saved`, Checkpointer._prune).
  Before: `cp -a global_step2 my_best_step2`, a `global_step4.bak` copy and a converted `weights.pth` in a tag
  folder were deleted with the run's checkpoints, without a word.
- `--resume auto` whose `latest` names a checkpoint that is gone, with nothing else to resume, is refused in one
  line (before: it started from step 0 and wrote a second history into metrics.jsonl).
- A folder a live run holds is refused as such first (before: "holds the checkpoints of an earlier run ... continue
  it with --resume auto", advice that then failed on the lock).
- Every command takes a checkpoint in the same three forms: a tag folder, a save folder, a run's --output_dir.

In-process on save folders laid out by hand as a save lays them out (DeepSpeed's file names, vim_ds's marker with
the files' sizes and CRCs): what is checked is names and markers. The refusals go through the real preflight and
claim of `vim-ds train`, one through the real command."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from vim_ds.checkpoint import deepspeed_dir as layout
from vim_ds.checkpoint.files import CheckpointError
from vim_ds.engine.checkpointing import Checkpointer

from train_utils import folder_bytes

# what a 1-rank ZeRO-0 save writes (Checkpointer.save: DeepSpeed's file, vim_ds's EMA and RNG state)
SAVED = ("mp_rank_00_model_states.pt", "ema.pt", "rng_rank0.pt")


def lay_out(save_dir, step: int, run_id: str = "run1", complete: bool = True, name: str = "") -> str:
    """A checkpoint folder as a save leaves it (`complete=False`: interrupted, no marker); returns its path."""
    tag_dir = os.path.join(save_dir, name or f"global_step{step}")
    os.makedirs(tag_dir)
    for file in SAVED:
        with open(os.path.join(tag_dir, file), "wb") as f:
            f.write(os.urandom(64 + step))
    if complete:
        marker = {"step": step, "epoch": 0, "run_id": run_id, "files": layout.file_checksums(tag_dir)}
        with open(os.path.join(tag_dir, layout.MARKER), "w") as f:
            json.dump(marker, f)
    return tag_dir


def entries(folder) -> list[str]:
    return sorted(os.listdir(folder))


def save(checkpointer: Checkpointer, step: int, run_id: str = "run1") -> None:
    """What Checkpointer.save does once a save is complete: the marker, `latest`, then the pruning."""
    lay_out(checkpointer.save_dir, step, run_id)
    with open(os.path.join(checkpointer.save_dir, "latest"), "w") as f:
        f.write(f"global_step{step}")
    checkpointer._prune(keep=f"global_step{step}")


# -- pruning removes what the run wrote ------------------------------------------------------------------------------


def test_pruning_keeps_a_users_copies_and_files(tmp_path, capsys):
    """The issue's steps: `cp -a global_step2 my_best_step2`, `global_step2` converted into
    `global_step2/weights.pth`, a `global_step4.bak` copy; then the run goes on with --keep-checkpoints 2."""
    save_dir = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        lay_out(save_dir, step)
    (save_dir / "latest").write_text("global_step4")
    shutil.copytree(save_dir / "global_step2", save_dir / "my_best_step2")
    shutil.copytree(save_dir / "global_step4", save_dir / "global_step4.bak")
    (save_dir / "global_step2" / "weights.pth").write_bytes(b"a converted file")
    users = {name: folder_bytes(save_dir / name) for name in ("my_best_step2", "global_step4.bak")}

    checkpointer = Checkpointer(None, str(save_dir), rank=0, keep_last=2)
    checkpointer.protect(str(save_dir / "global_step4"))  # resumed from it
    save(checkpointer, 5)
    save(checkpointer, 6)

    assert entries(save_dir) == ["global_step2", "global_step4.bak", "global_step5", "global_step6", "latest",
                                 "my_best_step2"]
    assert entries(save_dir / "global_step2") == ["weights.pth"]  # the checkpoint's files went, the user's stayed
    assert {name: folder_bytes(save_dir / name) for name in users} == users
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: --keep-checkpoints")]
    assert notes == [f"note: --keep-checkpoints: removed the checkpoint files of {save_dir / 'global_step2'} but kept "
                     f"the folder: it holds files the run did not write (weights.pth)"]
    # what they are still counts as theirs: a save folder resolves to the run's newest, not to a copy
    assert layout.complete_tags(str(save_dir)) == ["global_step5", "global_step6"]


def test_pruning_an_interrupted_save_or_a_universal_copy_keeps_a_users_files(tmp_path, capsys):
    """The variant: an interrupted save (no marker: removed by DeepSpeed's and vim_ds's file names) and a universal
    copy (removed by its marker's list), each holding a file of the user's; a folder of the run's name that holds
    nothing of the run's is left alone, without a word."""
    save_dir = tmp_path / "checkpoints"
    lay_out(save_dir, 1)
    universal = lay_out(save_dir, 1, name="global_step1_universal")
    os.makedirs(os.path.join(universal, "zero", "head.weight"))
    (save_dir / "global_step1_universal" / "zero" / "head.weight" / "fp32.pt").write_bytes(b"written by DeepSpeed")
    os.remove(os.path.join(universal, layout.MARKER))  # the marker lists the zero/ tree, as universal_copy's does
    marker = {"step": 1, "run_id": "run1", "universal_of": "global_step1", "files": layout.file_checksums(universal)}
    (save_dir / "global_step1_universal" / layout.MARKER).write_text(json.dumps(marker))
    (save_dir / "global_step1_universal" / "README").write_text("how I made it")
    lay_out(save_dir, 2, complete=False)  # killed while saving
    (save_dir / "global_step2" / "notes.txt").write_text("mine")
    (save_dir / "global_step3").mkdir()
    (save_dir / "global_step3" / "plot.png").write_bytes(b"mine too")

    checkpointer = Checkpointer(None, str(save_dir), rank=0, keep_last=1)
    save(checkpointer, 4)

    assert entries(save_dir) == ["global_step1_universal", "global_step2", "global_step3", "global_step4", "latest"]
    assert entries(save_dir / "global_step1_universal") == ["README"]
    assert entries(save_dir / "global_step2") == ["notes.txt"]
    assert entries(save_dir / "global_step3") == ["plot.png"]
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: --keep-checkpoints")]
    assert [line.split(" but ")[0] for line in notes] == [
        f"note: --keep-checkpoints: removed the checkpoint files of {save_dir / 'global_step2'}",
        f"note: --keep-checkpoints: removed the checkpoint files of {save_dir / 'global_step1_universal'}"]
    save(checkpointer, 5)  # nothing of the run's is left in them: no second word
    assert "note:" not in capsys.readouterr().out


def test_removing_a_save_takes_its_files_and_then_its_folder(tmp_path):
    """The control: a folder holding only what its save wrote goes whole (a complete checkpoint, an interrupted
    save, the clean-up of a failed save or universal conversion, which call the same remove_saved)."""
    complete, interrupted = lay_out(tmp_path, 1), lay_out(tmp_path, 2, complete=False)
    with open(os.path.join(interrupted, layout.MARKER + ".tmp123"), "w") as f:
        f.write("{")  # the marker's temporary, as write_atomic leaves it when killed
    assert layout.remove_saved(complete) == ([layout.MARKER, *sorted(SAVED)], [])
    assert layout.remove_saved(interrupted)[1] == []
    assert entries(tmp_path) == []


# -- `latest` naming a checkpoint that is gone ----------------------------------------------------------------------


def train_config(*argv):
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    return RunConfig.from_dict(vars(parse_args(["--data-set", "synthetic", "--synthetic-size", "32", "--nb-classes",
                                                "4", "--model", "vim_tiny", "--input-size", "32", "--model-kwargs",
                                                "depth=2", "embed_dim=32", "patch_size=4", "stride=4",
                                                *map(str, argv)])))


def run_folder(tmp_path, steps=(1, 2, 3, 4)):
    """A run's --output_dir: its checkpoints, `latest` naming the newest, metrics.jsonl's steps."""
    out = tmp_path / "run"
    for step in steps:
        lay_out(out / "checkpoints", step)
    (out / "checkpoints" / "latest").write_text(f"global_step{steps[-1]}")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in steps))
    return out


def test_resume_auto_refuses_when_latest_names_a_checkpoint_that_is_gone(tmp_path):
    """The issue's case, through `vim-ds train` itself: global_step4 deleted, nothing else complete."""
    from faults.test_refused_runs_leave_nothing import args
    from train_utils import error_line, run_train

    out = run_folder(tmp_path)
    for step in (1, 2, 3, 4):
        shutil.rmtree(out / "checkpoints" / f"global_step{step}")
    before = folder_bytes(out)
    proc = run_train(args(out, "--batch-size", 8, "--resume", "auto"), check=False)  # a run that would start
    save_dir = out / "checkpoints"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc) == (
        f"vim-ds train: error (rank 0): --resume auto: {save_dir / 'latest'} names global_step4, which is not there "
        f"(deleted or moved?), and {save_dir} holds no other complete checkpoint; starting from step 0 would write a "
        f"second history into {out}: put global_step4 back, or start anew with another --output_dir"), \
        proc.stderr[-3000:]
    assert folder_bytes(out) == before  # metrics.jsonl has one history; nothing written


def test_the_trainers_own_resume_plan_refuses_it_too(tmp_path):
    """The variant: the trainer's own resume plan (after the folder is claimed, the preflight's check repeated
    there) refuses it with the same line, with an interrupted save left beside it; and a save folder named to
    eval or convert (no `auto`) is refused naming the missing tag."""
    from vim_ds.engine.parts import auto_resume_path

    out = run_folder(tmp_path)
    for step in (1, 3, 4):
        shutil.rmtree(out / "checkpoints" / f"global_step{step}")
    os.remove(out / "checkpoints" / "global_step2" / layout.MARKER)  # interrupted
    with pytest.raises(CheckpointError, match=r"^--resume auto: .*latest names global_step4, which is not there"):
        auto_resume_path(str(out))
    with pytest.raises(CheckpointError) as refused:
        layout.resolve(str(out / "checkpoints"))
    assert str(refused.value) == (f"no complete checkpoint in {out / 'checkpoints'}: its `latest` names global_step4, "
                                  f"which is not there (deleted or moved?)")


def test_with_another_complete_checkpoint_the_missing_latest_is_said_and_the_newest_used(tmp_path, capsys):
    out = run_folder(tmp_path)
    shutil.rmtree(out / "checkpoints" / "global_step4")
    from vim_ds.engine.output_dir import latest_gone

    assert latest_gone(str(out)) is None  # resumable: not refused
    for _ in range(2):  # said once
        assert layout.resolve(str(out)) == (str(out / "checkpoints"), "global_step3")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {out / 'checkpoints' / 'latest'} names global_step4, which is not there (deleted or moved?); using "
        f"the newest complete checkpoint, global_step3"]


# -- the same three forms for every command that takes a checkpoint ------------------------------------------------


def test_a_tag_a_save_folder_and_an_output_dir_resolve_alike(tmp_path):
    out = run_folder(tmp_path, steps=(1, 2))
    save_dir = str(out / "checkpoints")
    assert layout.resolve(str(out)) == layout.resolve(save_dir) == layout.resolve(save_dir + "/global_step2") == \
        (save_dir, "global_step2")
    assert layout.save_dir_of(str(out)) == save_dir and layout.save_dir_of(save_dir) == save_dir


# -- a live run's folder is said to be one before any advice --------------------------------------------------------


# a live run's rank 0 as far as the folder sees it: an exclusive flock on the lock file, its record written in it
HOLDER = """
import fcntl, json, os, socket, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.truncate(0)
f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
f.flush()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """A run folder with checkpoints whose lock a live process holds, as rank 0 holds it."""
    import sys

    out = run_folder(tmp_path, steps=(1, 2, 3))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / ".vim_ds.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield out, holder
    finally:
        holder.kill()
        holder.wait()


def test_a_new_run_into_a_live_runs_folder_is_told_it_is_in_use(held):
    """The issue's case: a run without --resume into a folder whose run is saving was told to `--resume auto`."""
    from vim_ds.engine import preflight

    out, holder = held
    with pytest.raises(ValueError) as refused:
        preflight.check(train_config("--output_dir", out), is_main=True)
    assert str(refused.value).startswith(f"{out} is in use by another run (process {holder.pid} on "), refused.value
    holder.kill()  # the control: once it is gone, the earlier run's checkpoints are what is said
    holder.wait()
    with pytest.raises(ValueError, match="holds the checkpoints of an earlier run"):
        preflight.check(train_config("--output_dir", out), is_main=True)


def test_a_branch_into_a_live_runs_folder_and_the_claim_say_in_use_first(held):
    """The variants: `--resume` of an older step (whose advice, another --output_dir or `--resume NEWEST`, the lock
    would also fail), and the trainer's claim after the process group, which takes the lock before it looks at
    the folder; the holder's record is left as it was."""
    from vim_ds.engine import output_dir, preflight
    from vim_ds.runtime import distributed, write_journal

    out, holder = held
    older = out / "checkpoints" / "global_step1"
    record = (out / ".vim_ds.lock").read_text()
    with pytest.raises(ValueError, match=f"^{out} is in use by another run \\(process {holder.pid} "):
        preflight.check(train_config("--output_dir", out, "--resume", older), is_main=True)
    info = distributed.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=None)
    for config in (train_config("--output_dir", out), train_config("--output_dir", out, "--resume", older)):
        write_journal.start()  # as engine/run.py does around a claim that is refused
        with pytest.raises(ValueError, match=f"^{out} is in use by another run \\(process {holder.pid} "):
            output_dir.claim(config, info)
        write_journal.undo()
        output_dir.release()
    assert (out / ".vim_ds.lock").read_text() == record
