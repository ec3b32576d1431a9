"""The suite's fork server (tests/preloaded.py) runs a command as a new process would: the same training state, bit
for bit, as `python -m vim_ds.train` started for real, and the command's own environment and exit code."""
import os
import sys

import pytest

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, assert_same_state, config, train_env

pytestmark = pytest.mark.slow


def _args(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config("zero0"), "--precision", "fp32",
            "--batch-size", "8", "--max-steps", "2", "--lr", "2e-3", "--unscale-lr", "--warmup-epochs", "0",
            "--model-ema-decay", "0.8", "--save-interval", "2", *extra]


def test_a_forked_run_has_the_state_of_a_real_process_and_its_own_environment(digits, tmp_path, monkeypatch):
    """Weights, Adam moments, EMA, groups, scheduler and position of a 2-step run at lr 2e-3 (steps that move the
    weights) equal a real process's exactly; the control (the forked run at another lr) must differ, and a fault
    injected through the environment (read by vim_ds at import) must reach the forked process."""
    cmd = lambda out, *extra: [sys.executable, "-m", "vim_ds.train", *map(str, _args(digits, out, *extra))]  # noqa
    results = {}
    for name, enabled, extra in (("real", False, ()), ("forked", True, ()), ("control", True, ("--lr", "4e-3"))):
        monkeypatch.setattr(preloaded, "ENABLED", enabled)
        proc = preloaded.run(cmd(tmp_path / name, *extra), capture_output=True, text=True, env=train_env(),
                             cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = tmp_path / name / "checkpoints" / "global_step2"
    assert_same_state(results["forked"], results["real"])
    with pytest.raises(AssertionError):
        assert_same_state(results["control"], results["real"])

    monkeypatch.setattr(preloaded, "ENABLED", True)  # VIM_DS_INJECT is read when vim_ds.runtime.faults is imported
    proc = preloaded.run(cmd(tmp_path / "nan"), capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env=train_env({"VIM_DS_INJECT": "nan_loss@1"}))
    assert proc.returncode != 0 and "nan" in proc.stderr.lower(), (proc.returncode, proc.stderr[-2000:])


def test_every_rank_of_a_forked_launch_imports_vim_ds_from_its_own_path(tmp_path):
    """The ranks of a torchrun-like launch import vim_ds from the command's PYTHONPATH, as one process does (a
    worktree's vim_ds, its VIM_DS_* variables read at import): the server's handler, which imports vim_ds to pick
    the master port, leaves none of it to them (before: the 2 ranks ran the vim_ds the server's own sys.path found,
    the installed one). Here a vim_ds of this test's own, found first on PYTHONPATH; control: one process."""
    fake = tmp_path / "vim_ds"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "env.py").write_text("print('from', __file__)\n")
    for nproc, launch in ((1, []), (2, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])):
        cmd = [sys.executable, *launch, "-m", "vim_ds.env"]
        assert preloaded.parse_command(cmd) == ("vim_ds.env", [], nproc)  # forked, not started for real
        proc = preloaded.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split("\n").count(f"from {fake / 'env.py'}") == nproc, proc.stdout[-2000:]
