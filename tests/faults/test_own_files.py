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


from vim_ds.checkpoint import deepspeed_dir as layout
from vim_ds.engine.checkpointing import Checkpointer

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


def contents(folder) -> dict:
    """Every file under `folder` (relative path) with its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return out


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
    users = {name: contents(save_dir / name) for name in ("my_best_step2", "global_step4.bak")}

    checkpointer = Checkpointer(None, str(save_dir), rank=0, keep_last=2)
    checkpointer.protect(str(save_dir / "global_step4"))  # resumed from it
    save(checkpointer, 5)
    save(checkpointer, 6)

    assert entries(save_dir) == ["global_step2", "global_step4.bak", "global_step5", "global_step6", "latest",
                                 "my_best_step2"]
    assert entries(save_dir / "global_step2") == ["weights.pth"]  # the checkpoint's files went, the user's stayed
    assert {name: contents(save_dir / name) for name in users} == users
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
