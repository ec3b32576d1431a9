"""`vim-ds convert` stopped half-way: a full or read-only disk is one line and exit 2, a signal (SIGTERM, Ctrl-C,
SIGHUP) removes what was being written, says so in one line and exits 128 + the signal; a SIGKILL leaves nothing
under a user's name (vim_ds/checkpoint/atomic_write.py). And a `checkpoints/latest` that cannot be read (not UTF-8,
binary, empty) is ignored with a warning naming it, as one naming a missing tag is, in convert, train's resumes and
eval. Real converters and trainers on the suite's shared 3-step checkpoints, real mounts, real signals."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import preloaded
from train_utils import ROOT, config_run_args, folder_bytes, run_train, step_losses

pytestmark = pytest.mark.slow


def convert_cli(*args, env=None):
    return preloaded.run([sys.executable, "-m", "vim_ds.convert", *map(str, args)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env=env)


def only_line(proc, start: str) -> str:
    """The one line of stderr that starts with `start`; no traceback."""
    stderr = proc.stderr if isinstance(proc, subprocess.CompletedProcess) else stderr_of(proc)
    lines = [line for line in stderr.splitlines() if line.startswith(start)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@contextlib.contextmanager
def mounted(folder, *commands):
    """`folder` with `commands` (mount ...) applied; unmounted after. Mounting needs root (CI and this machine have
    it); elsewhere the test skips."""
    os.makedirs(folder, exist_ok=True)
    for command in commands:
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
            pytest.skip(f"cannot {' '.join(command[:3])} here: {proc.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def small_disk(folder, size: str = "64k"):
    """A tmpfs of `size` at `folder`: the converted tiny model (about 270 KiB, 130 as safetensors) does not fit."""
    return mounted(folder, ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)])


def read_only(folder):
    """`folder` as a read-only bind mount of itself: refused to root too (chmod is not), as a read-only disk is."""
    return mounted(folder, ["mount", "--bind", str(folder), str(folder)],
                   ["mount", "-o", "remount,bind,ro", str(folder), str(folder)])


@pytest.fixture(scope="module")
def ckpt(config_run) -> str:
    return os.path.join(config_run("zero0"), "checkpoints")  # global_step1..3, 2 ranks; read, never written


# -- a failed write --------------------------------------------------------------------------------------------------


EARLIER = {"model": "vim_tiny", "model_kwargs": {}, "num_classes": 10, "input_size": 32}  # a converted file's record


@pytest.mark.parametrize("name", ["w.pth", "w.safetensors"])  # torch's zip writer; safetensors (the variant)
def test_a_full_disk_is_one_line_exit_2_and_leaves_nothing(ckpt, tmp_path, name):
    from vim_ds.checkpoint.convert import write_weights_file

    with small_disk(tmp_path / "disk") as disk:
        out = disk / name
        # an earlier conversion (a file vim_ds wrote, which a conversion may replace): a failed one leaves it as it was
        write_weights_file(str(out), {"w": torch.zeros(2)}, EARLIER)
        earlier = out.read_bytes()
        proc = convert_cli(ckpt, out)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = only_line(proc, "vim-ds convert: error")
        assert line.startswith(f"vim-ds convert: error: cannot write {out}: No space left on device ("), line
        assert line.endswith(f" MiB free in {disk})"), line
        assert os.listdir(disk) == [name] and out.read_bytes() == earlier  # no temporary, OUT as it was


def test_a_read_only_disk_is_one_line_exit_2(ckpt, tmp_path):
    with read_only(tmp_path / "ro") as folder:
        with pytest.raises(OSError):  # the fault is real
            (folder / "x").write_text("x")
        proc = convert_cli(ckpt, folder / "w.pth")
        assert proc.returncode == 2
        assert only_line(proc, "vim-ds convert: error") == \
            f"vim-ds convert: error: cannot write {folder / 'w.pth'}: Read-only file system"
        # the variant: a missing folder on that disk (the converter creates OUT's folder)
        proc = convert_cli(ckpt, folder / "sub" / "w.pth")
        assert proc.returncode == 2
        assert only_line(proc, "vim-ds convert: error") == \
            f"vim-ds convert: error: cannot write {folder / 'sub' / 'w.pth'}: Read-only file system"
        assert os.listdir(folder) == []


# -- OUT never lands on a file the conversion reads, nor on a file vim_ds did not write -------------------------------


@pytest.fixture
def own_copy(ckpt, tmp_path):
    """A copy of the shared checkpoints: a refusal that failed would write over what it names."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(ckpt, copy)
    return copy


def test_convert_refuses_to_write_over_a_file_of_the_checkpoint_it_converts(own_copy):
    """The issue's case: OUT named the checkpoint's own model states, and eval then refused it as damaged."""
    before = folder_bytes(own_copy)
    tag_dir = own_copy / "global_step3"
    proc = convert_cli(own_copy, tag_dir / "mp_rank_00_model_states.pt")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert only_line(proc, "vim-ds convert: error") == (
        f"vim-ds convert: error: {tag_dir / 'mp_rank_00_model_states.pt'} is a file of the checkpoint being "
        f"converted ({tag_dir}): writing it would destroy the checkpoint; give OUT a new file outside {tag_dir}, e.g. "
        f"weights.pth")
    assert folder_bytes(own_copy) == before


def test_convert_refuses_what_it_reads_by_another_path_and_files_vim_ds_did_not_write(own_copy, tmp_path):
    """The variants: a file of the checkpoint through a linked folder, the save folder's `latest`, a checkpoint
    named by --tag; another checkpoint's DeepSpeed file and a published checkpoint (files vim_ds did not write).
    The control: a new file is written, and the conversion run again replaces the file it wrote."""
    from vim_ds.checkpoint.convert import convert
    from vim_ds.checkpoint.files import CheckpointError

    step2, step3 = own_copy / "global_step2", own_copy / "global_step3"
    os.symlink(step3, tmp_path / "view")
    published = tmp_path / "vim_s_midclstok_ft_81p6acc.pth"
    torch.save({"model": {"head.bias": torch.ones(10)}}, published)
    not_ours = "exists and is a PyTorch file with no vim_ds record: vim-ds convert replaces only a weights file " \
               "vim_ds wrote; give OUT a new name, or move {} away first"
    cases = [  # (OUT, --tag, the error)
        (tmp_path / "view" / "ema.pt", None, f"{tmp_path / 'view' / 'ema.pt'} is {step3 / 'ema.pt'}, a file of the "
         f"checkpoint being converted ({step3}): writing it would destroy the checkpoint; give OUT a new file outside "
         f"{step3}, e.g. weights.pth"),
        (own_copy / "latest", None, f"{own_copy / 'latest'} is a file of the checkpoint being converted ({step3})"),
        (step2 / "ema.pt", "global_step2", f"{step2 / 'ema.pt'} is a file of the checkpoint being converted ({step2})"),
        (step2 / "mp_rank_00_model_states.pt", None, f"{step2 / 'mp_rank_00_model_states.pt'} " +
         not_ours.format(step2 / "mp_rank_00_model_states.pt")),
        (published, None, f"{published} " + not_ours.format(published)),
    ]
    before = folder_bytes(tmp_path)
    for out, tag, error in cases:
        with pytest.raises(CheckpointError) as refused:
            convert(str(own_copy), str(out), tag=tag)
        assert str(refused.value).startswith(error), (out, refused.value)
    assert folder_bytes(tmp_path) == before
    out = tmp_path / "w.pth"
    assert convert(str(own_copy), str(out))["step"] == 3
    assert convert(str(own_copy), str(out), tag="global_step2")["step"] == 2  # over the file it wrote
    assert torch.load(out, weights_only=True)["vim_ds"]["step"] == 2


def test_every_command_takes_a_runs_output_dir(config_run, digits, tmp_path):
    """The issue's case: `vim-ds eval --resume RUNDIR` said "no complete checkpoint" where `vim-ds convert RUNDIR`
    found RUNDIR/checkpoints; eval's weights are the same whichever of the three forms names them. The variant:
    `vim-ds convert RUNDIR --tag global_step2`."""
    from train_utils import config_run_args
    from vim_ds.checkpoint.convert import convert
    from vim_ds.config.components import model_config
    from vim_ds.engine.evaluate import load_eval_weights
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    run = config_run("zero0")
    loaded = []
    for source in (run, os.path.join(run, "checkpoints"), os.path.join(run, "checkpoints", "global_step3")):
        argv = config_run_args(digits, tmp_path, "zero0", "--resume", source, "--eval")
        config = RunConfig.from_dict(vars(parse_args([str(a) for a in argv])))
        model = model_config(config, 10).build()
        ema = load_eval_weights(config, model)
        loaded.append((model.state_dict(), ema))
    for weights, ema in loaded[1:]:
        assert all(torch.equal(weights[k], loaded[0][0][k]) for k in weights)
        assert all(torch.equal(ema[k], loaded[0][1][k]) for k in ema)
    assert convert(run, str(tmp_path / "w.pth"), tag="global_step2")["step"] == 2


# -- a signal while it writes ----------------------------------------------------------------------------------------


def start_stalled(*args, env_extra=None):
    """A converter stopped for good once OUT's bytes are written, before OUT gets them (VIM_DS_INJECT), in its own
    session; returns it once it says so."""
    env = dict(os.environ, VIM_DS_INJECT="stall_convert_write@1", **(env_extra or {}))
    proc = preloaded.popen([sys.executable, "-m", "vim_ds.convert", *map(str, args)], env=env, cwd=ROOT,
                           start_new_session=True)
    deadline = time.monotonic() + 120
    while "VIM_DS_INJECT: stalled writing" not in stderr_of(proc):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the converter did not reach the write (rc {proc.poll()}):\n{stderr_of(proc)[-3000:]}")
        time.sleep(0.1)
    return proc


def stderr_of(proc) -> str:
    if isinstance(proc, preloaded.Process):
        return proc.output()[1]
    return ""  # a real process (VIM_DS_TEST_FORK_SERVER=0): read when it ends


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],  # SIGHUP: the variant
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_while_writing_removes_the_file_and_says_so_in_one_line(ckpt, tmp_path, signum):
    if not preloaded.ENABLED:
        pytest.skip("watches the converter's stderr while it runs (the suite's preloaded server)")
    out = tmp_path / "out" / "w.pth"
    proc = start_stalled(ckpt, out)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    stderr = stderr_of(proc)
    assert only_line(proc, "vim-ds convert: stopped") == \
        f"vim-ds convert: stopped by {signal.Signals(signum).name}; {out} was not written", stderr[-3000:]
    assert "error" not in stderr.lower()
    assert os.listdir(out.parent) == []


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named_temporary"])
def test_sigkill_while_writing_leaves_nothing_a_user_sees(ckpt, tmp_path, named):
    """SIGKILL cannot be caught. Where the filesystem supports O_TMPFILE (here: the test's tmp folder) the bytes
    being written have no name and vanish with the process. Elsewhere (forced here with VIM_DS_NO_TMPFILE=1) a
    hidden `.OUT.tmp.HOST.PID` stays, and the next convert into that folder removes it, as it removes the
    `OUT.tmpPID` files earlier versions left."""
    if not preloaded.ENABLED:
        pytest.skip("watches the converter's stderr while it runs (the suite's preloaded server)")
    from vim_ds.checkpoint.atomic_write import temporary_name

    out = tmp_path / "out" / "w.pth"
    proc = start_stalled(ckpt, out, env_extra={"VIM_DS_NO_TMPFILE": "1"} if named else None)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    if not named:
        assert os.listdir(out.parent) == []
        return
    left = os.path.basename(temporary_name(str(out), proc.pid))
    assert left.startswith(".w.pth.tmp.") and os.listdir(out.parent) == [left]
    (out.parent / f"w.pth.tmp{proc.pid}").write_bytes(b"what an earlier version left")
    (out.parent / "notes.txt").write_text("a user's file")  # not a temporary: kept
    proc = convert_cli(ckpt, out, env=dict(os.environ, VIM_DS_NO_TMPFILE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out.parent)) == ["notes.txt", "w.pth"]


def test_a_universal_conversion_on_a_full_disk_is_one_line_and_removes_its_folder(config_run, tmp_path):
    src = os.path.join(config_run("zero2"), "checkpoints", "global_step3")
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    with small_disk(tmp_path / "disk", f"{size // 1024 + 64}k") as disk:  # the source fits, its copy does not
        shutil.copytree(src, disk / "global_step3")
        (disk / "global_step3_universal").mkdir()  # a user's note in the folder: the clean-up keeps it (issue 50)
        (disk / "global_step3_universal" / "notes.txt").write_text("mine")
        proc = convert_cli(disk, "--universal")
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = only_line(proc, "vim-ds convert: error")
        assert line.startswith(f"vim-ds convert: error: cannot convert {disk / 'global_step3'} to a universal "
                               f"checkpoint: No space left on device"), line
        # what the conversion wrote is gone (without the note, the folder too: the signal test below)
        assert os.listdir(disk / "global_step3_universal") == ["notes.txt"]


@pytest.mark.parametrize("words", ["RuntimeError: basic_ios::clear: iostream error",  # the C++ stream (CI's run)
                                   "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 64",
                                   ""])
def test_a_full_or_read_only_disk_is_named_whatever_words_the_universal_writer_used(tmp_path, words):
    """ds_to_universal's writers report a full disk in their own words, or none: the disk itself is looked at (a
    real full tmpfs and a real read-only mount); a failure on a disk with room keeps the writer's last line."""
    from vim_ds.engine.checkpointing import _universal_failure

    stderr = f"Traceback (most recent call last):\n  ...\n{words}\n" if words else ""
    with small_disk(tmp_path / "full", "64k") as full:
        with contextlib.suppress(OSError):
            (full / "filler").write_bytes(b"x" * 2 ** 17)  # more than fits: the disk is full
        assert _universal_failure(stderr, str(full)) == "No space left on device"
    with read_only(tmp_path / "ro") as ro:
        assert _universal_failure(stderr, str(ro)) == "Read-only file system"
    assert _universal_failure(stderr, str(tmp_path)) == (words or "no output")


def test_a_signal_during_a_universal_conversion_removes_its_folder(config_run, tmp_path):
    if not preloaded.ENABLED:
        pytest.skip("watches the converter's stderr while it runs (the suite's preloaded server)")
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(os.path.join(config_run("zero2"), "checkpoints", "global_step3"), save_dir / "global_step3")
    proc = start_stalled(save_dir, "--universal")  # ds_to_universal has written the folder, the marker is not there
    universal = save_dir / "global_step3_universal"
    assert os.path.isdir(universal / "zero")  # the fault is real: a partial universal checkpoint
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert only_line(proc, "vim-ds convert: stopped") == \
        f"vim-ds convert: stopped by SIGTERM; {universal} was not written"
    assert sorted(os.listdir(save_dir)) == ["global_step3", "latest_universal"]  # DeepSpeed's note, as on success


# -- `latest` that cannot be read ------------------------------------------------------------------------------------

LATEST = {"not_utf8": b"\xff\xfeglobal_step\x80", "binary": b"\x00\x01\x02\x7f\x00", "empty": b""}
PROBLEM = {"not_utf8": "it is not UTF-8 text (byte 0xff at offset 0)", "empty": "it is empty",
           "binary": "it holds no tag name (binary or control characters)"}


def garbled(config_run, tmp_path, kind: str):
    run = tmp_path / "run"
    shutil.copytree(config_run("zero0"), run)
    latest = run / "checkpoints" / "latest"
    latest.write_bytes(LATEST[kind])
    return run, (f"warning: ignoring {latest}: {PROBLEM[kind]}; using the newest complete checkpoint, "
                 f"global_step3")


@pytest.mark.parametrize("kind", list(LATEST))
def test_convert_ignores_an_unreadable_latest_with_a_warning(config_run, tmp_path, kind):
    run, warning = garbled(config_run, tmp_path, kind)
    proc = convert_cli(run / "checkpoints", tmp_path / "w.pth")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warning in proc.stderr.splitlines() and "Traceback" not in proc.stderr
    assert "step 3 " in proc.stdout


def test_train_resumes_past_an_unreadable_latest_with_a_warning(digits, config_run, tmp_path):
    """--resume auto (the issue's case: a codec error stopped the run) and, the variant, --resume SAVE_DIR into
    another output folder; `vim-ds eval --resume SAVE_DIR` too."""
    run, warning = garbled(config_run, tmp_path, "not_utf8")
    one_rank = ["--batch-size", "8", "--accum-steps", "2", "--max-steps", "4"]  # the same global batch of 16
    proc = run_train(config_run_args(digits, run, "zero0", *one_rank, "--resume", "auto"), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines().count(warning) == 1, proc.stderr[-3000:]
    assert "at epoch 0, step 3" in proc.stdout and max(step_losses(run)) == 4

    save_dir = tmp_path / "copy" / "checkpoints"
    shutil.copytree(config_run("zero0") + "/checkpoints", save_dir)
    (save_dir / "latest").write_bytes(LATEST["not_utf8"])
    warning = warning.replace(str(run / "checkpoints"), str(save_dir))
    branch = tmp_path / "branch"
    proc = run_train(config_run_args(digits, branch, "zero0", *one_rank, "--resume", save_dir), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines().count(warning) == 1 and "at epoch 0, step 3" in proc.stdout

    proc = run_train(config_run_args(digits, tmp_path / "eval", "zero0", "--resume", save_dir), module="vim_ds.eval",
                     check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines().count(warning) == 1 and "Traceback" not in proc.stderr
