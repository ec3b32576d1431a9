"""The DeepSpeed configs that travel with the package (`--deepspeed_config NAME`, `vim-ds configs`), and bad input
reported before the process group or DeepSpeed starts (vim_ds/engine/preflight.py)."""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY

SHIPPED = sorted(name[:-len(".json")] for name in os.listdir(os.path.join(ROOT, "ds_configs"))
                 if name.endswith(".json"))


def json_config_lines(stdout: str) -> list[str]:
    """The lines of `vim-ds configs` that list DeepSpeed configs (after its first line, before the recipes')."""
    lines = stdout.splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line.startswith("Recipes")), len(lines))
    return lines[:end]


def vim_ds(*args, cwd=ROOT, env=None, timeout=300):
    return preloaded.run([sys.executable, "-m", "vim_ds.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


def test_configs_lists_every_shipped_file_with_what_it_holds():
    proc = vim_ds("configs")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in json_config_lines(proc.stdout)}
    assert sorted(lines) == SHIPPED
    for name, line in lines.items():
        with open(os.path.join(ROOT, "ds_configs", f"{name}.json")) as f:
            config = json.load(f)
        assert f"ZeRO-{config['zero_optimization']['stage']}" in line, line
    assert "bf16" in lines["zero2"] and "[the default]" in lines["zero2"]
    assert "fp16" in lines["zero2_fp16"] and "autocast-bf16" in lines["zero3_autocast"]
    assert "parameters and optimizer states offloaded" in lines["zero3_offload"]
    assert "optimizer states offloaded" in lines["zero2_offload"] and "offloaded" not in lines["zero2"]


def test_configs_write_copies_them_and_never_replaces_a_file(tmp_path):
    out = tmp_path / "mine"
    proc = vim_ds("configs", "--write", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.json" for name in SHIPPED]
    for name in SHIPPED:
        assert filecmp.cmp(out / f"{name}.json", os.path.join(ROOT, "ds_configs", f"{name}.json"), shallow=False)
    (out / "zero2.json").write_text("{}")  # the user's edit
    proc = vim_ds("configs", "--write", out)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "already holds" in proc.stderr and (out / "zero2.json").read_text() == "{}"


def test_a_name_resolves_to_the_shipped_file_and_a_path_wins(tmp_path, monkeypatch):
    from vim_ds.config.shipped_configs import resolve

    for given in ("zero3_offload", "zero3_offload.json", "ds_configs/zero3_offload.json"):
        monkeypatch.chdir(tmp_path)  # outside the repository: no ds_configs/ folder here
        assert filecmp.cmp(resolve(given), os.path.join(ROOT, "ds_configs", "zero3_offload.json"), shallow=False)
    (tmp_path / "zero2").write_text("{}")  # a file of the same name in the working folder is the user's file
    assert resolve("zero2") == "zero2"
    with pytest.raises(ValueError, match=r"^DeepSpeed config not found: zero9 .*shipped: zero0, zero1"):
        resolve("zero9")
    with pytest.raises(ValueError, match="not found"):
        resolve("elsewhere/zero2.json")  # a path into another folder is a path, not a name


def test_our_deepspeed_options_are_deepspeeds():
    """vim-ds train defines DeepSpeed's four options itself (so that it parses without importing DeepSpeed): the
    same option strings, defaults, types and actions as deepspeed.add_config_arguments."""
    import deepspeed

    from vim_ds.cli.run_options import add_deepspeed_arguments

    def options(parser):
        return {a.dest: (tuple(a.option_strings), a.default, a.type, type(a).__name__) for a in parser._actions
                if a.dest != "help"}

    ours, theirs = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_deepspeed_arguments(ours)
    deepspeed.add_config_arguments(theirs)
    assert options(ours) == options(theirs)


def test_deepscale_config_is_read_as_deepspeeds_deprecated_spelling():
    from vim_ds.cli.run_options import parse_args

    assert parse_args(["--deepscale_config", "zero3"]).deepspeed_config == "zero3"
    assert parse_args(["--deepscale_config", "zero3", "--deepspeed_config", "zero3"]).deepspeed_config == "zero3"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--deepscale_config", "zero3", "--deepspeed_config", "zero1"])
    assert exit_.value.code == 2


# -- fail fast --------------------------------------------------------------------------------------------------

# The trainer's entry as a launcher runs it, once for each command line given (a JSON list), and after each what
# had happened by the time it returned: one process for all the cases (their imports are most of their time), so a
# case that imports DeepSpeed goes last. VIM_DS_NO_PREFLIGHT=1 (the negative control) replaces the preflight checks
# with nothing, as if they did not exist.
DRIVER = r"""
import contextlib, gc, io, json, os, sys
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
started = []
def recording(real):
    def init_process_group(*args, **kwargs):
        started.append(1)
        return real(*args, **kwargs)
    return init_process_group
dist.init_process_group = c10d.init_process_group = recording(c10d.init_process_group)
from vim_ds.engine.run import run
from vim_ds.cli.run_options import parse_config
if os.environ.get("VIM_DS_NO_PREFLIGHT"):
    import vim_ds.engine.preflight as preflight
    preflight.check = lambda config, is_main: config
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = run(parse_config(argv))
    engines = [o for o in gc.get_objects() if type(o).__name__ in ("DeepSpeedEngine", "Trainer")]
    print("RESULT " + json.dumps({"rc": rc, "deepspeed_imported": "deepspeed" in sys.modules, "stderr": err.getvalue(),
                                  "stdout": out.getvalue(), "process_group": bool(started), "engines": len(engines)}))
"""


def _earlier_run(tmp_path):
    out = tmp_path / "earlier"
    (out / "checkpoints" / "global_step4").mkdir(parents=True)
    return out


# (case, extra arguments, the error's words, whether the check needs DeepSpeed's own config schema), in the order
# they run in one process: the config check whose schema is DeepSpeed's last
BAD_INPUT = [
    ("config name", lambda p: ["--deepspeed_config", "zero9"], "DeepSpeed config not found: zero9", False),
    ("config JSON", lambda p: ["--deepspeed_config", _write(p / "bad.json", '{"zero_optimization": {"stage": 5}')],
     "invalid JSON", False),
    ("data path", lambda p: ["--data-set", "folder", "--data-path", p / "nowhere"], "does not exist", False),
    ("data layout", lambda p: ["--data-set", "folder", "--data-path", _mkdir(p / "d" / "train" / "a")],
     "val is missing", False),
    ("model name", lambda p: ["--model", "vim_huge"], "unknown model 'vim_huge'", False),
    ("model kwargs", lambda p: ["--model-kwargs", "depth=2", "bogus=3"], "unexpected keyword argument 'bogus'",
     False),
    ("finetune file", lambda p: ["--finetune", p / "no.pth"], "--finetune", False),
    ("resume path", lambda p: ["--resume", p / "no_run"], "--resume", False),
    ("earlier run", lambda p: ["--output_dir", _earlier_run(p)], "holds the checkpoints of an earlier run", False),
    ("unwritable", lambda p: ["--output_dir", _write(p / "a_file", "") / "run"], "cannot write checkpoints",
     False),  # a file in the way (a read-only folder would not stop root, who runs CI)
    ("config type", lambda p: ["--deepspeed_config",
                               _write(p / "t.json", '{"zero_optimization": {"stage": "two"}}')], "stage", True),
    # issue 50, item 7: a number in the JSON that a typed option contradicts (it used to win without a word)
    ("config vs command line", lambda p: ["--deepspeed_config", _json_with(p / "c.json", gradient_clipping=0.01),
                                          "--clip-grad", "100"],
     'c.json sets gradient_clipping=0.01 but --clip-grad is 100; set it to "auto" or drop --clip-grad', True),
]


def _json_with(path, **top):
    """The shipped zero0.json with the top-level values `top`."""
    with open(os.path.join(ROOT, "ds_configs", "zero0.json")) as f:
        return _write(path, json.dumps({**json.load(f), **top}))


def _write(path, text):
    path.write_text(text)
    return path


def _mkdir(path):
    path.mkdir(parents=True)
    return path.parent.parent


def _base(tmp_path):
    return ["--data-set", "synthetic", "--synthetic-size", 16, "--nb-classes", 4, *TINY, *QUIET_AUG,
            "--batch-size", 4, "--max-steps", 1, "--num_workers", 0, "--deepspeed_config", "zero0", "--precision",
            "fp32", "--output_dir", tmp_path / "run"]


def _drive(tmp_path, command_lines, env=None):
    """[result of each command line (the base options, then its own)], run by DRIVER in one process."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    argvs = [[str(a) for a in _base(tmp_path) + list(extra)] for extra in command_lines]
    proc = subprocess.run([sys.executable, str(script), json.dumps(argvs)], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout=600)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(argvs), proc.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    lines = []
    for case, extra, _, _ in BAD_INPUT:
        (root / case.replace(" ", "_")).mkdir()
        lines.append(extra(root / case.replace(" ", "_")))
    return dict(zip([c[0] for c in BAD_INPUT], _drive(root, lines)))


@pytest.mark.parametrize("case,words,needs_deepspeed", [(c, w, d) for c, _, w, d in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_before_the_process_group_and_deepspeed(bad_input_results, case, words,
                                                                      needs_deepspeed):
    """Each is refused with exit 2 and one error line, with no process group and no DeepSpeed engine; all but a
    config whose values DeepSpeed's own schema checks also before DeepSpeed is imported at all."""
    result = bad_input_results[case]
    errors = [line for line in result["stderr"].splitlines() if "error" in line]
    assert result["rc"] == 2 and len(errors) == 1, result["stderr"][-3000:]
    assert errors[0].startswith("vim-ds train: error (rank 0): ") and words in errors[0], errors
    assert not result["process_group"] and not result["engines"], result
    assert result["deepspeed_imported"] == needs_deepspeed, result


def test_control_without_the_checks_the_same_error_comes_after_the_process_group(tmp_path):
    """The negative control of the test above: with the preflight checks taken out, a missing data path is still
    refused (by the trainer), but only once DeepSpeed is imported and the process group is up."""
    (result,) = _drive(tmp_path, [["--data-set", "folder", "--data-path", tmp_path / "nowhere"]],
                       env={"VIM_DS_NO_PREFLIGHT": "1"})
    assert result["rc"] == 2 and "does not exist" in result["stderr"], result["stderr"][-2000:]
    assert result["deepspeed_imported"] and result["process_group"], result


def test_time_to_an_error_through_the_console_script(tmp_path):
    """What a user waits for a typo, the whole process (`vim-ds train`, a missing data path) timed: printed for
    the docs, not asserted (the machine is shared); the error must be the preflight's, before any process group."""
    start = time.monotonic()
    proc = vim_ds("train", "--data-path", tmp_path / "nowhere", cwd=tmp_path)
    seconds = time.monotonic() - start
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr[-2000:]
    assert "process group" not in proc.stderr and "DeepSpeed" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    print(f"vim-ds train with a missing --data-path: exit 2 after {seconds:.2f} s")


def test_without_deepspeed_config_the_default_is_said_and_trains(tmp_path):
    """Without --deepspeed_config the default is said; without --output_dir too (issue 50, item 16d: a run that
    keeps nothing said so only at the end, on a stop signal)."""
    (result,) = _drive(tmp_path, [["--deepspeed_config", "", "--output_dir", ""]])
    assert result["rc"] == 0, result["stderr"][-3000:]
    assert "note: no --deepspeed_config given: using the shipped zero2 (" in result["stdout"]
    assert "ZeRO-2" in result["stdout"], result["stdout"][-2000:]
    assert ("note: no --output_dir: nothing of this run is kept (no checkpoints, no metrics.jsonl, no options.yaml); "
            "give --output_dir DIR to keep them") in result["stdout"], result["stdout"][-2000:]
    assert not (tmp_path / "run").exists()


def test_a_run_that_keeps_nothing_says_so_at_its_start(tmp_path, capsys):
    """The variant of the note above: --output_dir not given at all (a recipe's command line), said by the checks
    every run makes before its process group; not said with a folder, nor by an evaluation (which writes none)."""
    from vim_ds.engine import preflight
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    argv = ["--data-set", "synthetic", "--synthetic-size", "16", "--nb-classes", "4", *TINY, "--batch-size", "4",
            "--deepspeed_config", "zero0", "--precision", "fp32"]
    said = "note: no --output_dir: nothing of this run is kept"
    for extra, expected in (([], True), (["--output_dir", str(tmp_path / "run")], False), (["--eval"], False)):
        preflight.check(RunConfig.from_dict(vars(parse_args(argv + extra))), is_main=True)
        assert (said in capsys.readouterr().out) == expected, extra


@pytest.mark.slow
def test_a_wheel_in_a_fresh_venv_outside_the_repository_trains_from_a_shipped_name(tmp_path):
    """`pip wheel` of the repository, installed by the pip of a fresh virtual environment (`python -m venv`), run
    through that environment's own `vim-ds` console script from a folder outside the repository: `vim-ds configs`
    lists the wheel's copies (and recipes) and `--deepspeed_config zero1` trains from the wheel's file, with the
    wheel's recipe `--config vim_tiny_pretrain` under the command line's options.

    One thing is not fresh: the venv finds the project's dependencies (torch, deepspeed, timm, ...) in this
    environment's site-packages, named in a .pth file, instead of downloading torch (200 MB) at every run. That
    folder is added as a plain path, so its own .pth files (this checkout's editable install of vim_ds) are not
    read: vim_ds can only come from the wheel, which the test checks. The venv's pip still resolves the wheel's
    declared dependencies against what it sees, so an undeclared one is a failure of the import or of the run.
    The kernels are not built into the wheel (VIM_DS_BUILD_CPU=0), so the first run JIT-builds the CPU kernel from
    the wheel's own csrc/ into VIM_DS_CACHE, as it does for any install without them; `vim-ds env` then finds it
    there and uses it. This is the suite's test of that path (it compiles the kernel once; a folder of its own, so
    a build cached on the machine cannot stand in). The source is copied first so that nothing built earlier in the
    checkout (build/) goes in."""
    import site as site_module
    import sysconfig

    import torch

    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.so", "__pycache__",
                                                                 "*.egg-info", ".pytest_cache", "output"))
    env = {**os.environ, "VIM_DS_BUILD_CPU": "0", "VIM_DS_BUILD_GPU": "0"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "wheels")], cwd=source, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").iterdir()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    dependencies = [p for p in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                              *site_module.getsitepackages()]) if os.path.isdir(p)]
    with open(os.path.join(venv_site, "dependencies_of_the_test_environment.pth"), "w") as f:
        f.write("\n".join(dependencies) + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cache = tmp_path / "jit_cache"
    clean.update(PYTHONNOUSERSITE="1", PATH=os.pathsep.join([str(venv / "bin"), clean.get("PATH", "")]),
                 VIM_DS_CACHE=str(cache))
    clean.pop("VIM_DS_JIT", None)
    # the venv's own setuptools (python 3.11 seeds one, older than torch asks for) would hide the environment's
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], capture_output=True, env=clean,
                   timeout=300)
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", str(wheel)], capture_output=True,
                          text=True, timeout=300, env=clean)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]  # --no-index: every dependency found
    site = venv_site + "/"
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([python, "-c", "import vim_ds; print(vim_ds.__file__)"], capture_output=True,
                           text=True, cwd=work, env=clean)
    assert where.stdout.strip() == site + "vim_ds/__init__.py", (where.stdout, where.stderr[-2000:])

    def console(*args):
        return subprocess.run([str(venv / "bin" / "vim-ds"), *map(str, args)], capture_output=True, text=True,
                              cwd=work, env=clean, timeout=300)

    listed = console("configs")
    assert listed.returncode == 0 and site + "vim_ds/ds_configs" in listed.stdout, listed.stderr
    assert sorted(line.split()[0] for line in json_config_lines(listed.stdout)) == SHIPPED
    assert site + "vim_ds/ds_configs/recipes" in listed.stdout and "vim_small_pretrain" in listed.stdout
    # a recipe from the wheel (its model, weight decay, ...) with the command line winning where it says otherwise
    run = console("train", "--config", "vim_tiny_pretrain", "--deepspeed_config", "zero1", "--precision", "fp32",
                  "--data-set", "synthetic", "--synthetic-size", 16, "--nb-classes", 4, *TINY, *QUIET_AUG,
                  "--batch-size", 4, "--max-steps", 1, "--num_workers", 0, "--output_dir", work / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"DeepSpeed config: zero1 = {site}vim_ds/ds_configs/zero1.json" in run.stdout, run.stdout
    assert "ZeRO-1" in run.stdout
    recorded = (work / "run" / "options.yaml").read_text()
    assert "weight_decay: 0.1\n" in recorded and "model: vim_tiny\n" in recorded and "batch_size: 4\n" in recorded
    # the kernel the wheel does not hold, JIT-built from the wheel's sources into the cache, and reused from there
    built = cache / f"cpu-torch{torch.__version__}"
    assert f"vim_ds._scan_cpu is not installed; JIT-building it into {built}" in run.stderr, run.stderr[-3000:]
    (library,) = built.glob("*.so")
    compiled_at = library.stat().st_mtime_ns
    report = console("env", "--json")
    assert report.returncode == 0, report.stderr[-3000:]
    info = json.loads(report.stdout)
    assert info["scan_backends"]["cpu"]["available"] and info["scan_backends"]["cpu"]["how"].startswith("jit, ")
    assert info["scan_backend_in_use"] == {"cpu": "cpu"}, info["scan_backend_in_use"]
    assert library.stat().st_mtime_ns == compiled_at  # found built: not compiled a second time
