"""`bash tools/gpu_check.sh` end to end on this CPU machine (every GPU step says "no GPU", the report says so, exit
0), and its report generator fed the files of a GPU run (measured / bound, mamba_ssm side by side)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

from vim_ds.cli.bench import gpu_report, scan, scan_layouts, scan_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real thing (minutes)")
def test_gpu_check_on_a_cpu_reports_no_gpu_and_the_predictions(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("STEPS", None)  # every step
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    report = (out / "report.md").read_text()
    assert "**Device:** no GPU on this machine" in report
    for step in ("build", "tests", "layouts", "model", "train", "profile", "split", "sanitize"):
        assert f"| {step} | skipped (no GPU) |" in report
    assert "## Where a training step's time goes" in report
    assert "| scan | no GPU: predictions only, measured n/a |" in report
    assert "no GPU: measured n/a" in report and "no GPU: the GPU tests" in report
    assert "| mamba_ssm | not installed |" in report and f"| torch | {torch.__version__} |" in report
    # The predictions are the model's numbers.
    b = scan_model.predict(8, 384, 6085, 16, "bfloat16")["bounds"]["MI300X"]
    assert f"{b['fwd_ms']:.3f} ({b['fwd_bound_by']}) / {b['fwd_bwd_ms']:.3f}" in report
    assert json.loads((out / "bench_scan.json").read_text())["predictions"] == json.loads(
        json.dumps(scan_model.predictions()))


def test_steps_limits_what_runs(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, STEPS="scan",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if torch.cuda.is_available():
        pytest.skip("on a GPU the scan step times the kernels (minutes)")
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line.split("\t")[0] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == ["scan"]


# a test marked for the GPU: decorated, a parameter's marks, or a module's pytestmark
GPU_MARK = re.compile(r"^\s*@pytest\.mark\.gpu\b|marks=[^\n]*pytest\.mark\.gpu\b"
                      r"|^pytestmark\b[^\n]*pytest\.mark\.gpu\b", re.M)


def test_the_tests_step_runs_every_file_with_gpu_tests():
    """gpu_check's tests step names each test file that has GPU tests (`pytest.mark.gpu`), but the one it leaves to a
    call of its own (test_ds_config.py: a real engine from each shipped config), and no file without them: a GPU
    test in a file left out would never run on the GPU sessions' one command."""
    script = (pathlib.Path(ROOT) / "tools" / "gpu_check.sh").read_text()
    step = script[script.index("run_step tests "):]
    step = step[:step.index("\n    else")]
    listed = set(re.findall(r"tests/((?:\w+/)?test_\w+\.py)", step))
    tests = pathlib.Path(ROOT) / "tests"
    with_gpu_tests = {p.relative_to(tests).as_posix() for p in tests.rglob("test_*.py")
                      if GPU_MARK.search(p.read_text())}
    assert {"test_rms_norm.py", "faults/test_bad_steps.py"} <= with_gpu_tests  # (the parse finds them)
    mark = "pytest.mark." + "gpu"  # (split: this file has no GPU test)
    assert GPU_MARK.search(f'    pytest.param("cuda", marks={mark})') and GPU_MARK.search(
        f"pytestmark = [{mark}]") and not GPU_MARK.search(f"(`{mark}`)")
    assert listed == with_gpu_tests - {"test_ds_config.py"}, (sorted(listed), sorted(with_gpu_tests))


FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
    *"torch.cuda.is_available()"*) echo 1; exit 0 ;;
    *"get_device_name"*) echo "a stand-in GPU"; exit 0 ;;
    *"torch.__version__"*) echo "torch (a stand-in)"; exit 0 ;;
    *"-m vim_ds.bench.gpu_report"*) exec {real} "$@" ;;
    *"import selective_scan_cuda"*) exit 0 ;;
    *"--target /tmp/site"*) exit 0 ;;
    *"-m vim_ds"* | *"-m pip"* | *"-m pytest"*) {gpu_step} ;;
esac
exec {real} "$@"
"""


@pytest.mark.slow  # (about 30 s: the cut step runs until the deadline)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real thing (minutes)")
def test_the_deadline_cuts_the_step_that_runs_long_and_the_report_is_still_written(tmp_path):
    """A GPU step that runs past what is left of the check's DEADLINE is cut there, the steps after it are not
    started, and the report (which the device call must bring back) is written within the deadline. The GPU is
    mocked, as it cannot exist here: a stand-in python says CUDA is available and turns each GPU step's command
    into a long sleep (the report's generator runs for real)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable, gpu_step="exec sleep 300"))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), STEPS="layouts train split", DEADLINE="45",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # a step ran out of time
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == ["layouts", "train", "split"]
    # the first step got what was left of the 45 s less the report's 20 (less the script's start-up)
    cut = int(steps[0][1].removeprefix("timed out after ").split(" ")[0])
    assert 15 <= cut <= 25 and steps[0][1].endswith("s, the 45-s deadline"), steps[0]
    assert steps[1][1] == steps[2][1] == "not run: the 45-s deadline came first"
    report = (out / "report.md").read_text()
    assert "| train | not run: the 45-s deadline came first |" in report
    assert f"| layouts | timed out after {cut} s, the 45-s deadline |" in report
    # within the deadline, with room for a loaded machine's slow report; without the deadline the layouts step alone
    # would have run its own 150 s (the negative control: the limit the deadline cut)
    assert elapsed < 90, elapsed
    assert "run_step layouts 150 " in (pathlib.Path(ROOT) / "tools" / "gpu_check.sh").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real thing (minutes)")
def test_the_steps_run_in_the_order_issue_51_needs_them(tmp_path):
    """With a GPU (mocked, as it cannot exist here: a stand-in python says CUDA is available and mamba_ssm's
    extension imports, and ends each GPU step's command at once), every step runs, in the order that puts first
    what a single device call must bring back (the kernels' correctness and speed beside mamba_ssm's, then where a
    training step's time goes) and last what can wait for another call; the report is written."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable, gpu_step="exit 0"))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), SANITIZER="/nowhere/compute-sanitizer",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("STEPS", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    steps = [line.split("\t")[0] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == ["build", "tests", "scan", "profile", "layouts", "train", "split", "model", "sanitize"], (
        steps, proc.stdout[-2000:])
    report = (out / "report.md").read_text()
    assert "| scan | ok |" in report
    assert "| sanitize | skipped (no compute-sanitizer at /nowhere/compute-sanitizer) |" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real thing (minutes)")
def test_the_sanitize_step_runs_each_tool_over_the_kernels_program(tmp_path):
    """compute-sanitizer's racecheck, synccheck and memcheck each run tools/gpu_sanitize.py, each its own step and
    log; a tool's errors (its --error-exitcode) fail that step. The GPU and the sanitizer are stand-ins, as neither
    can exist here: the sanitizer records its arguments and runs the program on the CPU's kernels (the program's
    --device cpu), failing as racecheck would find a hazard when asked to."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable, gpu_step="exit 0"))
    fake.chmod(0o755)
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {tmp_path}/calls
[ "$2" != racecheck ] || [ -z "${{HAZARD:-}}" ] || {{ echo "========= ERROR SUMMARY: 1 error"; exit 3; }}
shift 4
exec {sys.executable} "$2" --device cpu
""")
    sanitizer.chmod(0o755)
    for hazard, outcomes in (("", ["ok", "ok", "ok"]), ("1", ["failed (exit 3)", "ok", "ok"])):
        out = tmp_path / f"out{hazard}"
        env = dict(os.environ, OUT=str(out), PYTHON=str(fake), STEPS="sanitize", SANITIZER=str(sanitizer),
                   HAZARD=hazard, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == (1 if hazard else 0), proc.stdout[-2000:]
        steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
        assert [s[0] for s in steps] == ["sanitize-racecheck", "sanitize-synccheck", "sanitize-memcheck"]
        assert [s[1] for s in steps] == outcomes
        ran = (out / "sanitize_memcheck.log").read_text()
        assert "forward and backward calls ran on the CPU" in ran, ran
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == f"--tool racecheck --error-exitcode 3 {fake} tools/gpu_sanitize.py", calls


def _gpu_run(tmp_path, with_mamba):
    """The files a GPU run of gpu_check.sh leaves, with measured rows made up (no GPU here to measure them)."""
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.00\ntorch 2.11.0+cu130 13.0\n")
    (tmp_path / "steps.tsv").write_text("build\tok\t95\tbuild.log\ntests\tok\t40\tgpu_tests.log\n"
                                        "scan\tok\t120\tbench_scan.log\nmodel\tfailed (exit 1)\t30\tbench_model.log\n")
    (tmp_path / "gpu_tests.log").write_text("....\n31 passed, 2 skipped in 40.1s\n")
    gpu = scan_model.gpu_for_device("NVIDIA H100 80GB HBM3")
    rows = []
    for (shape, _), ms in zip(scan_model.BENCH_SHAPES, (0.5, 2.0, 0.3, 1.5)):
        row = dict(device="cuda", gpu="NVIDIA H100 80GB HBM3", shape=scan_model.shape_text(*shape),
                   shape_tuple=list(shape), dtype="bfloat16", kernel_fwd_ms=ms, kernel_fwd_bwd_ms=4 * ms)
        if with_mamba:
            row.update(mamba_fwd_ms=ms / 2, mamba_fwd_bwd_ms=ms)
        rows.append(scan.annotate(row, gpu))
    conv = dict(op="causal_conv1d", device="cuda", shape="B=64 D=768 L=785 K=4", dtype="bfloat16",
                kernel_fwd_ms=0.031, kernel_fwd_bwd_ms=0.125, ref_fwd_ms=0.25, ref_fwd_bwd_ms=1.5, speedup_fwd=8.06,
                speedup_fwd_bwd=12.0)
    norm = dict(op="add_rms_norm", device="cuda", shape="B=64 L=785 D=384", dtype="bfloat16", kernel_fwd_ms=0.05,
                kernel_fwd_bwd_ms=0.2, ref_fwd_ms=0.125, ref_fwd_bwd_ms=0.5, speedup_fwd=2.5, speedup_fwd_bwd=2.5,
                max_abs_diff=0.0078125)
    (tmp_path / "bench_scan.json").write_text(json.dumps(
        {"device": "NVIDIA H100 80GB HBM3", "modelled_gpu": gpu.name, "rows": rows,
         "predictions": scan_model.predictions(), "gpus": scan_model.gpus_used()}).replace(
        '"rows": [', '"rows": [' + json.dumps(conv) + ", " + json.dumps(norm) + ", ", 1))
    # the profile step's: the H200 summary of tests/test_step_profile.py, through `vim-ds bench profile`
    from test_step_profile import _h200_summary

    summary = _h200_summary("bf16")
    (tmp_path / "bench_profile.json").write_text(json.dumps({"summary": summary}))
    # the layouts step's: what `vim-ds bench scan --layouts` writes on a GPU, times made up
    layouts = []
    picked = (scan_layouts.LAYOUTS[0], scan_layouts.LAYOUTS[-1])  # the launcher's own (a chain), dB/dC partials
    for (label, caps), bwd, ms in zip(picked, ([32, 4, 32, 24, 1, 0], [32, 4, 32, 24, 1, 1]), (10.0, 12.5)):
        shape = (64, 768, 785, 16)
        layouts.append(dict(device="cuda", gpu="NVIDIA H100 80GB HBM3", shape=scan_model.shape_text(*shape),
                            dtype="bfloat16", layout=label, caps=list(caps), fwd_layout=[32, 1, 8, 96, 1],
                            bwd_layout=bwd, design_bytes=scan_layouts.design_bytes(*shape, bwd), kernel_fwd_ms=2.0,
                            kernel_fwd_bwd_ms=ms, vs_own_fwd_bwd=ms / 10.0))
    (tmp_path / "bench_layouts.json").write_text(json.dumps(layouts))
    (tmp_path / "bench_split.json").write_text(json.dumps(
        {"settings": {"share_gpu": True}, "rows": [
            {"ranks": 1, "threads": None, "peak_bytes": 123456789, "forward_s": 0.01, "backward_s": 0.02},
            {"ranks": 2, "threads": None, "peak_bytes": 61728394, "forward_s": 0.02, "backward_s": 0.03}]}))
    return rows


@pytest.mark.parametrize("with_mamba", [True, False])
def test_report_of_a_gpu_run_has_every_number_and_the_ratio(tmp_path, with_mamba):
    rows = _gpu_run(tmp_path, with_mamba)
    assert gpu_report.main([str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "**Device:** NVIDIA H100 80GB HBM3" in report and "31 passed, 2 skipped" in report
    assert "| model | failed (exit 1) |" in report and "no GPU" not in report
    for r in rows:
        bound = scan_model.predict(*r["shape_tuple"], "bfloat16")["bounds"]["H100 SXM"]
        ratio = f"{r['kernel_fwd_ms'] / bound['fwd_ms']:.1f}x, {r['kernel_fwd_bwd_ms'] / bound['fwd_bwd_ms']:.1f}x"
        line = next(line for line in report.splitlines() if line.startswith(f"| {r['shape']} | bfloat16 | "
                                                                           f"{r['kernel_fwd_ms']:.3f}"))
        assert ratio in line and f"{bound['fwd_ms']:.3f}" in line
        if with_mamba:
            assert f"{r['mamba_fwd_bwd_ms'] / bound['fwd_bwd_ms']:.1f}x" in line
    assert ("mamba_ssm: not installed, so not timed." in report) != with_mamba
    # the conv's row in a table of its own (the scan's table has none of it), ours beside F.conv1d
    assert "| B=64 D=768 L=785 K=4 | bfloat16 | 0.031 | 0.125 | 0.250 | 1.500 | 8.1x, 12.0x |" in report
    assert report.count("B=64 D=768 L=785 K=4") == 1
    # the blocks' add and norm in a table of their own, our Triton kernel beside PyTorch's composition
    assert "| B=64 L=785 D=384 | 0.050 | 0.200 | 0.125 | 0.500 | 2.5x, 2.5x | 0.0078 |" in report
    assert report.count("B=64 L=785 D=384") == 1
    # the profile's tables, the ops beside their rooflines on the H200
    assert "Operators beside their rooflines (roofline GPU: H200 SXM; bfloat16)" in report
    assert "| `selective_scan_bwd` | 96 | 400.000 | 60.0 % |" in report and "| `aten::bmm` | 64x768x384 " in report
    # the layouts' table: the design's bytes from the layout (stored states 64 x 768 x 25 chunks x 16 x 4 bytes,
    # written and read: 157 MB; partials 2 x 2 x 64 x 24 x 16 x 785 x 4 bytes: 309 MB), the times and the ratio
    assert "| B=64 D=768 L=785 N=16 | bfloat16 | own | 32 | 4 (32) | 24 | 1 (1) | 157 | chain | 2.000 | 10.000 | " \
           "1.0x |" in report
    assert "| dB/dC partials | 32 | 4 (32) | 24 | 1 (1) | 157 | partials 309 MB | 2.000 | 12.500 | 1.2x |" in report
    # the sequence split's rows (bench split --share-gpu)
    assert "## The sequence split's memory per rank" in report and "| 2 | — | 61728394 |" in report


def test_report_generator_rejects_a_missing_folder(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path / "nope")]) == 2
    assert "usage" in capsys.readouterr().err


def _mamba_script(args, env_extra, cwd=ROOT):
    env = dict(os.environ, PYTHON=sys.executable, **env_extra)
    return subprocess.run(["bash", os.path.join(ROOT, "tools", "build_mamba_ssm.sh"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _fake_sdist(path, kernel_files):
    """A source package shaped like mamba-ssm's (top folder, csrc/selective_scan, LICENSE, a tests/ folder that
    must not be kept), with empty files: enough for fetch's unpacking and build's checks, nothing to compile."""
    import tarfile

    top = path.parent / "mamba_ssm-9.9.9"
    (top / "csrc" / "selective_scan").mkdir(parents=True)
    (top / "tests").mkdir()
    (top / "tests" / "test_big.py").write_text("x = 1\n")
    (top / "LICENSE").write_text("license\n")
    for name in kernel_files:
        (top / "csrc" / "selective_scan" / name).write_text("// empty\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(top, arcname=top.name)


def test_build_mamba_ssm_keeps_only_the_kernel_and_refuses_in_one_line(tmp_path):
    """tools/build_mamba_ssm.sh (issue 51's mamba_ssm on the lent GPU) without a network or a GPU: `fetch` of a
    source package on disk keeps csrc/selective_scan and LICENSE only, with where it came from; `build` refuses in
    one line, exit 2, where it cannot build (no source fetched, no GPU and no TORCH_CUDA_ARCH_LIST, a kernel file
    missing), and neither replaces a folder of the user's where it would write. The build itself needs nvcc and
    minutes of compiling: run by hand and on a GPU (docs/performance.md)."""
    kernels = ["selective_scan.cpp"] + [f"selective_scan_fwd_{t}.cu" for t in ("fp32", "fp16", "bf16")] + [
        f"selective_scan_bwd_{t}_{k}.cu" for t in ("fp32", "fp16", "bf16") for k in ("real", "complex")]
    sdist = tmp_path / "pkg" / "mamba_ssm-9.9.9.tar.gz"
    sdist.parent.mkdir()
    _fake_sdist(sdist, kernels)
    where = tmp_path / "m"
    env = {"MAMBA_SSM_DIR": str(where)}

    none = _mamba_script(["build"], env)
    assert none.returncode == 2 and none.stderr.strip().startswith(
        "build_mamba_ssm.sh: error: ") and "holds no mamba-ssm source: run 'bash tools/build_mamba_ssm.sh fetch'" \
        in none.stderr, none.stderr

    fetched = _mamba_script(["fetch", str(sdist)], env)
    assert fetched.returncode == 0, fetched.stderr
    kept = sorted(str(p.relative_to(where / "src")) for p in (where / "src").rglob("*") if p.is_file())
    assert kept == sorted(["LICENSE", "VIM_DS_SOURCE"] + [f"csrc/selective_scan/{k}" for k in kernels])
    assert (where / "src" / "VIM_DS_SOURCE").read_text().startswith(f"9.9.9 {sdist} sha256:")

    no_gpu = _mamba_script(["build"], {**env, "TORCH_CUDA_ARCH_LIST": ""})
    if not torch.cuda.is_available():
        assert no_gpu.returncode == 2, no_gpu.stderr
        assert no_gpu.stderr.strip().splitlines()[-1] == ("build_mamba_ssm.sh: error: no GPU to build for: set "
                                                          "TORCH_CUDA_ARCH_LIST (e.g. 9.0) to build anyway")
    (where / "src" / "csrc" / "selective_scan" / "selective_scan_bwd_bf16_real.cu").unlink()
    missing = _mamba_script(["build"], {**env, "TORCH_CUDA_ARCH_LIST": "9.0", "CUDA_HOME": "/usr/local/cuda"})
    if torch.version.cuda and os.path.exists("/usr/local/cuda/bin/nvcc"):
        assert missing.returncode == 2, missing.stderr
        assert "expected mamba_ssm's 9 kernel files and its binding" in missing.stderr.strip().splitlines()[-1]

    # a folder of the user's where the script would write is never replaced: src/ by fetch, build/ by build
    theirs = tmp_path / "theirs"
    (theirs / "src").mkdir(parents=True)
    (theirs / "src" / "notes.txt").write_text("mine\n")
    kept = _mamba_script(["fetch", str(sdist)], {"MAMBA_SSM_DIR": str(theirs)})
    assert kept.returncode == 2 and "is not a source this script fetched" in kept.stderr, kept.stderr
    assert sorted(os.listdir(theirs / "src")) == ["notes.txt"]
    (where / "build").mkdir()
    (where / "build" / "model.pt").write_text("mine\n")
    kept = _mamba_script(["build"], {**env, "TORCH_CUDA_ARCH_LIST": "9.0"})
    assert kept.returncode == 2 and "is not a build of this script" in kept.stderr, kept.stderr
    assert sorted(os.listdir(where / "build")) == ["model.pt"]

    bad = tmp_path / "mamba_ssm-1.0.tar.gz"
    bad.write_bytes(b"not a tarball")
    refused = _mamba_script(["fetch", str(bad)], env)
    assert refused.returncode == 2 and "source package does not unpack" in refused.stderr, refused.stderr
    assert (where / "src" / "VIM_DS_SOURCE").exists()  # what was fetched before is kept


def test_build_mamba_ssm_cubin_compiles_the_four_kernel_files_with_its_flags(tmp_path):
    """`build_mamba_ssm.sh cubin` (mamba_ssm's kernels for tools/sass_loops.py --mamba, no GPU needed) with a
    stand-in nvcc that records its arguments (the real compile takes minutes; the figures it gave are in
    docs/performance.md): the forward and backward files of bf16 and fp32 (real weights), each to a cubin for the
    asked architecture in MAMBA_CUBIN_DIR (not in .mamba_ssm, which travels to the GPU), with mamba_ssm's nvcc flags
    and torch's headers; one line and exit 2 without a source, for a malformed ARCH, when nvcc fails and for a
    folder of the user's (not written into)."""
    kernels = [f"selective_scan_fwd_{t}.cu" for t in ("fp32", "bf16")] + [
        f"selective_scan_bwd_{t}_real.cu" for t in ("fp32", "bf16")]
    sdist = tmp_path / "pkg" / "mamba_ssm-9.9.9.tar.gz"
    sdist.parent.mkdir()
    _fake_sdist(sdist, kernels)
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$NVCC_LOG"\n'
                    'while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n[ -z "$NVCC_FAIL" ]\n')
    nvcc.chmod(0o755)
    out = tmp_path / "cubins"
    env = {"MAMBA_SSM_DIR": str(tmp_path / "m"), "MAMBA_CUBIN_DIR": str(out), "NVCC": str(nvcc),
           "NVCC_LOG": str(tmp_path / "nvcc.log")}
    none = _mamba_script(["cubin"], env)
    assert none.returncode == 2 and "holds no mamba-ssm source" in none.stderr.strip().splitlines()[-1], none.stderr
    assert _mamba_script(["fetch", str(sdist)], env).returncode == 0

    done = _mamba_script(["cubin", "100"], env)
    assert done.returncode == 0, done.stderr
    names = ["bwd_bf16_real", "bwd_fp32_real", "fwd_bf16", "fwd_fp32"]
    assert sorted(os.listdir(out)) == sorted([f"{n}_sm_100.cubin" for n in names] + [f"{n}_sm_100.log" for n in names]
                                             + ["VIM_DS_CUBIN"])
    assert done.stdout.split() == [str(out / f"{n}_sm_100.cubin") for n in names]
    calls = (tmp_path / "nvcc.log").read_text().splitlines()
    assert len(calls) == 4
    include = f"-I{os.path.dirname(torch.__file__)}{os.sep}include"
    for call in calls:
        words = call.split()
        assert words[:2] == ["-cubin", "-arch=sm_100"] and "--use_fast_math" in words and "-O3" in words
        assert "-U__CUDA_NO_BFLOAT16_CONVERSIONS__" in words and include in words, call
    assert not (tmp_path / "m" / "cubin").exists()

    bad = _mamba_script(["cubin", "9.0"], env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "build_mamba_ssm.sh: error: cubin: ARCH is a compute capability without the dot, such as 90, not '9.0'")
    failed = _mamba_script(["cubin"], {**env, "NVCC_FAIL": "1"})
    assert failed.returncode == 2 and failed.stderr.strip().splitlines()[-1] == (
        f"build_mamba_ssm.sh: error: cubin: nvcc failed; see {out}/*_sm_90.log"), failed.stderr

    # a folder of the user's, not made by this script, is not written into: its files stay as they are
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "fwd_bf16_sm_90.cubin").write_text("mine\n")
    kept = _mamba_script(["cubin"], {**env, "MAMBA_CUBIN_DIR": str(theirs)})
    assert kept.returncode == 2 and "is not a folder of this script" in kept.stderr, kept.stderr
    assert os.listdir(theirs) == ["fwd_bf16_sm_90.cubin"] and (theirs / "fwd_bf16_sm_90.cubin").read_text() == "mine\n"


def test_gpu_wheels_takes_this_environments_versions_for_the_gpu_machines_python(tmp_path):
    """tools/gpu_wheels.sh --dry-run: DeepSpeed built into a wheel and DeepSpeed's pydantic and hjson downloaded as
    binaries for CPython 3.12 (the lent image's), each at the version installed here; a package missing here is one
    line and exit 2. (The fetch itself needs a package index: run by hand, `bash tools/gpu_wheels.sh`.)"""
    from importlib.metadata import version

    script = os.path.join(ROOT, "tools", "gpu_wheels.sh")
    proc = subprocess.run(["bash", script, "--dry-run"], env=dict(os.environ, PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    build, download = proc.stdout.strip().splitlines()
    assert build.startswith("DS_BUILD_OPS=0 ") and " -m pip wheel " in build
    assert build.endswith(f" deepspeed=={version('deepspeed')}")
    assert " --only-binary=:all: --python-version 3.12 --implementation cp " in download
    for name in ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "hjson"):
        assert f" {name}=={version(name)}" in download, name
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\nexit 1\n")
    fake.chmod(0o755)
    missing = subprocess.run(["bash", script, "--dry-run"], env=dict(os.environ, PYTHON=str(fake)),
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"gpu_wheels.sh: error: deepspeed is not installed in {fake}; install the project (pip install -e .) first"]


STAND_IN_PIP = """#!/usr/bin/env bash
# importlib.metadata's version query: 1.0 for each package; pip wheel / download: an empty wheel per NAME==VERSION
case "$*" in
    *importlib.metadata*) echo 1.0; exit 0 ;;
esac
dir=""; names=()
while [ $# -gt 0 ]; do
    case $1 in
        -w | -d) dir=$2; shift ;;
        *==*) names+=("$1") ;;
    esac
    shift
done
for n in "${names[@]}"; do n=${n//-/_}; : > "$dir/${n%%==*}-${n##*==}-py3-none-any.whl"; done
"""


def test_gpu_wheels_replaces_its_own_packages_wheels_and_no_others(tmp_path):
    """A fetch into a folder that already holds an older wheel of one of its packages and a wheel of the user's own:
    the older one is replaced (two versions of a package stop gpu_check's install), the user's is left as it was.
    pip is a stand-in (no package index here): it writes an empty wheel per package asked for."""
    fake = tmp_path / "python"
    fake.write_text(STAND_IN_PIP)
    fake.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "hjson-0.9-py3-none-any.whl").write_text("old")
    (wheels / "mine-2.0-py3-none-any.whl").write_text("the user's")
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_wheels.sh")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=str(fake), WHEEL_DIR=str(wheels)), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in wheels.iterdir()) == sorted(
        ["mine-2.0-py3-none-any.whl"] + [f"{n}-1.0-py3-none-any.whl" for n in (
            "deepspeed", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "hjson")])
    assert (wheels / "mine-2.0-py3-none-any.whl").read_text() == "the user's"
