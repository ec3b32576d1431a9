"""`vim-ds train --profile-steps FIRST:LAST` (engine/profiling.py) and `vim-ds bench profile`
(cli/bench/step_profile.py): the real trainer profiled over whole optimizer steps, a Chrome trace and the top
kernels on disk, and each large operator beside its roofline on the GPU that ran it (issue 51, item 2). The profiled
run is the shared "control" run of tests/conftest.py (one rank, 3 steps, steps 2-3 profiled): no training run of its
own. On a CPU the tables are by CPU time and the rooflines are not drawn; the roofline arithmetic is checked on a
summary as an H200 would write it, against the datasheets' numbers worked out here by hand."""
from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from vim_ds.cli.bench import main as bench_main
from vim_ds.cli.bench import scan_model, step_anatomy, step_profile
from vim_ds.cli.run_options import parse_config
from vim_ds.config.run_config import RunConfig
from vim_ds.config.run_rules import profile_steps, validate


def test_profile_steps_are_read_and_their_rules_said_in_one_line(capsys, tmp_path):
    assert profile_steps("") is None and profile_steps("5:8") == (5, 8) and profile_steps("4") == (4, 4)
    for bad in ("8:5", "0:2", "a:b", "3:"):
        with pytest.raises(ValueError, match="--profile-steps must be FIRST:LAST"):
            profile_steps(bad)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--profile-steps", "8:5", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "vim-ds train: error: --profile-steps must be FIRST:LAST with 1 <= FIRST <= LAST, got '8:5'" in \
        capsys.readouterr().err
    # it writes into the run's folder: none given, refused (a config made in code says the same)
    assert validate(RunConfig.from_dict({"profile_steps": "2:3"})) == (
        "--profile-steps writes its profile to OUTPUT_DIR/profile: give --output_dir")
    assert validate(RunConfig.from_dict({"profile_steps": "2:3", "output_dir": str(tmp_path)})) is None


@pytest.mark.slow
def test_a_profiled_run_writes_its_trace_and_top_kernels(config_run, capsys, tmp_path):
    run = config_run("control")  # --profile-steps 2:3 (tests/conftest.py)
    folder = os.path.join(run, "profile")
    with gzip.open(os.path.join(folder, "trace.json.gz"), "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "vim_ds::bimamba_branch_fwd" in names and "vim_ds::bimamba_branch_bwd" in names
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == [2, 3] and summary["profiled_steps"] == 2 and summary["device"] == "cpu"
    assert summary["precision"] == "fp32" and summary["wall_ms_per_step"] > 0
    # two optimizer steps of 2 micro steps: each of the 2 blocks' mixers (both directions in one op) runs once per
    # micro step
    branch = [op for op in summary["ops"] if op["name"] == "vim_ds::bimamba_branch_fwd"]
    assert sum(op["calls"] for op in branch) == 2 * 2 * 2
    assert branch[0]["shapes"][0] == [8, 64, 65]  # (micro batch, d_inner, patches + class token)
    shares = [k["share"] for k in summary["kernels"]]
    assert summary["kernels"] and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    with open(os.path.join(folder, "top_kernels.md")) as f:
        assert f.read().startswith("Top kernels by CPU (self) time over optimizer steps 2-3")
    # the bench reads the folder (or the run's), and says the rooflines are not drawn on a CPU
    assert bench_main(["profile", run, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "Operators beside their rooflines (roofline GPU: none on a CPU; float32)" in out
    # every operator's own time, by kind; the run's model and batch for the step on paper (not drawn on a CPU)
    assert summary["run"] == {"model": summary["run"]["model"], "model_kwargs": summary["run"]["model_kwargs"],
                              "num_classes": summary["run"]["num_classes"], "input_size": summary["run"]["input_size"],
                              "micro_batch": 8, "micro_steps": 2}
    names = {op["name"] for op in summary["op_times"]}
    assert {"vim_ds::bimamba_branch_fwd", "vim_ds::bimamba_branch_bwd", "aten::bmm"} <= names and summary[
        "device_ms_per_step"] is None
    assert "| Vim's branch kernels (scan, conv) | " in out and "| total | " in out
    assert "| `vim_ds::bimamba_branch_fwd` | 8x64x65" in out
    assert json.loads((tmp_path / "p.json").read_text())["summary"]["steps"] == [2, 3]


def test_bench_profile_of_a_folder_without_one_says_so_in_one_line(tmp_path, capsys):
    assert bench_main(["profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vim-ds bench profile: error: {tmp_path}: no profile here")
    (tmp_path / "summary.json").write_text("{not json")
    assert bench_main(["profile", str(tmp_path)]) == 2
    assert "not a readable profile summary" in capsys.readouterr().err


def _h200_summary(precision):
    """A summary as an H200 run of Vim-small stride 8 (batch 64) would write it, times made up."""
    return {"device": "cuda", "device_name": "NVIDIA H200", "steps": [5, 6], "profiled_steps": 2,
            "precision": precision, "wall_ms_per_step": 700.0, "time": "device (self)", "timed_ms": 1300.0,
            "kernels": [{"name": "selective_scan_bwd", "calls": 96, "ms": 800.0, "ms_per_step": 400.0, "share": 0.6}],
            "ops": [
                # in_proj's x half: (64 x 768 x 384) @ (64 x 384 x 785), 2 * 64*768*384*785 FLOPs a call
                {"name": "aten::bmm", "shapes": [[64, 768, 384], [64, 384, 785]], "calls": 96, "ms": 96.0,
                 "ms_per_step": 48.0, "flops": 96 * 2 * 64 * 768 * 384 * 785},
                {"name": "vim_ds::ssm_branch_fwd", "shapes": [[64, 768, 785], [64, 768, 785], [768, 1, 4], [768],
                                                             [56, 768], [768, 24], [768, 16]],
                 "calls": 96, "ms": 240.0, "ms_per_step": 120.0, "flops": 0},
                {"name": "vim_ds::causal_conv1d", "shapes": [[64, 768, 785], [768, 1, 4], [768]], "calls": 96,
                 "ms": 9.6, "ms_per_step": 4.8, "flops": 0},
                {"name": "aten::add", "shapes": [[64, 785, 384], [64, 785, 384]], "calls": 48, "ms": 4.8,
                 "ms_per_step": 2.4, "flops": 0}]}


def test_each_kind_of_operator_beside_the_step_on_paper():
    """The by-kind table: the operators' own times added up by kind (aten::view moves nothing: no kind), the device
    time no operator launched beside the optimizer's step on paper, and the paper's kinds from `vim-ds bench
    anatomy` for the run's model and batch, the operators' times the micro steps of an optimizer step."""
    run = {"model": "vim_tiny", "model_kwargs": {"depth": 2, "embed_dim": 32, "patch_size": 8, "stride": 8},
           "num_classes": 10, "input_size": 32, "micro_batch": 4, "micro_steps": 2}
    times = {"aten::bmm": 3.0, "aten::addmm": 1.0, "vim_ds::ssm_branch_fwd": 2.0, "aten::add": 1.0,
             "aten::_to_copy": 0.5, "aten::view": 0.25}
    summary = dict(_h200_summary("bf16"), run=run, device_ms_per_step=9.0,
                   op_times=[{"name": k, "calls": 2, "ms_per_step": v} for k, v in times.items()])
    text, _ = step_profile.report(summary)
    rows = {r["kind"]: r for r in step_profile.by_kind(summary, scan_model.gpu_for_device("NVIDIA H200"))}
    measured = {k: r["ms_per_step"] for k, r in rows.items()}
    assert measured == {"matrix products": 4.0, "Vim's branch kernels (scan, conv)": 2.0, "norms": 0.0,
                        "elementwise": 1.0, "reductions": 0.0, "casts and copies": 0.5,
                        step_profile.OUTSIDE: 1.5, "total": 9.0}
    kwargs = dict(run["model_kwargs"], num_classes=10)
    paper = {k["kind"]: k["ms"] for k in step_anatomy.anatomy("vim_tiny", 4, 32, "bf16", "H200 SXM", kwargs)["kinds"]}
    assert rows["matrix products"]["paper_ms_per_step"] == pytest.approx(2 * paper["matrix products"])
    assert rows[step_profile.OUTSIDE]["paper_ms_per_step"] == pytest.approx(paper["optimizer (AdamW)"])
    assert rows["total"]["paper_ms_per_step"] == pytest.approx(
        2 * sum(paper.values()) - paper["optimizer (AdamW)"])
    line = next(x for x in text.splitlines() if x.startswith("| matrix products |"))
    assert line == (f"| matrix products | 4.000 | {2 * paper['matrix products']:.3f} | "
                    f"{4.0 / (2 * paper['matrix products']):.1f}x |")
    # a summary from before op_times: no such table; a GPU that is not modelled: measured only
    assert "by kind of operator" not in step_profile.report(_h200_summary("bf16"))[0]
    assert all(r["paper_ms_per_step"] is None for r in step_profile.by_kind(summary, None))


def test_a_gpu_profiles_operators_and_device_time_add_up_without_counting_a_kernel_twice():
    """summarize() on a GPU profile (a stand-in for torch.profiler's averages: no GPU here): an operator's own device
    time is the kernels it launched; a host range (the optimizer's step) has its kernels' time too, and the kernels
    themselves appear as device events: the device's total counts each kernel once, the operators' times only the
    operators'."""
    from types import SimpleNamespace

    from vim_ds.engine import profiling

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(key, device_us, kind, count=2):
        return SimpleNamespace(key=key, count=count, self_device_time_total=device_us, device_time_total=device_us,
                               self_cpu_time_total=10.0, cpu_time_total=10.0, device_type=kind, input_shapes=[],
                               flops=0)

    events = [event("aten::add", 2000.0, cpu), event("vim_ds::ssm_branch_fwd", 3000.0, cpu),
              event("Optimizer.step#AdamW.step", 1000.0, cpu), event("aten::view", 0.0, cpu),
              event("elementwise_kernel", 2000.0, cuda), event("selective_scan_fwd_kernel", 3000.0, cuda),
              event("multi_tensor_apply_kernel", 1000.0, cuda)]
    prof = SimpleNamespace(key_averages=lambda group_by_input_shape=False: events)
    summary = profiling.summarize(prof, 2, 0.5, True, "NVIDIA H200", (5, 6))
    assert summary["device_ms_per_step"] == pytest.approx(3.0)  # 6 ms of kernels over 2 steps, each once
    assert {op["name"]: op["ms_per_step"] for op in summary["op_times"]} == {"aten::add": 1.0,
                                                                            "vim_ds::ssm_branch_fwd": 1.5}
    rows = {r["kind"]: r["ms_per_step"] for r in step_profile.by_kind(summary, None)}
    assert rows[step_profile.OUTSIDE] == pytest.approx(0.5) and rows["total"] == pytest.approx(3.0)


def test_rooflines_on_an_h200_from_the_datasheets():
    text, rows = step_profile.report(_h200_summary("bf16"))
    bmm, branch, conv, add = rows
    # bf16 tensor cores, 989.4 TFLOPS dense: 2 * 64*768*384*785 FLOPs a call = 0.0300 ms; the two operands and the
    # result as their shapes say, 2 bytes each, at 4.8 TB/s: 0.0320 ms, the larger (48 calls a step)
    flops, elems = 2 * 64 * 768 * 384 * 785, 64 * 768 * 384 + 64 * 384 * 785 + 64 * 768 * 785
    per_call = max(flops / 989.4e12, elems * 2 / 4.8e12) * 1e3
    assert per_call == pytest.approx(0.0320, abs=1e-4)
    assert bmm["roofline_ms_per_step"] == pytest.approx(48 * per_call) and bmm["bound_by"] == "bytes"
    assert bmm["ratio"] == pytest.approx(48.0 / (48 * per_call))
    # the branch: its scan's forward bound at (64, 768, 785, N = 16), bf16, on the H200 (scan_model)
    bound = scan_model.predict(64, 768, 785, 16, "bfloat16")["bounds"]["H200 SXM"]["fwd_ms"]
    assert branch["roofline_ms_per_step"] == pytest.approx(48 * bound) and branch["bound_by"] == \
        "scan model (the scan alone)"
    # both directions in one op (the model's): two scans' bounds
    both = dict(_h200_summary("bf16"))
    both["ops"] = [dict(both["ops"][1], name="vim_ds::bimamba_branch_fwd", calls=48)]
    row = step_profile.report(both)[1][0]
    assert row["roofline_ms_per_step"] == pytest.approx(2 * 24 * bound) and row["bound_by"] == \
        "scan model (the scans alone)"
    # the conv forward moves x and out: 2 x 64*768*785 x 2 bytes at 4.8 TB/s
    assert conv["roofline_ms_per_step"] == pytest.approx(48 * 2 * 64 * 768 * 785 * 2 / 4.8e12 * 1e3)
    assert "roofline_ms_per_step" not in add and "| `aten::add` | 64x785x384 64x785x384 | 24 | 2.400 | — | — |" in text
    # an fp32 run's matrix products against the FP32 peak (67 TFLOPS: TF32 stays off): 0.442 ms a call
    fp32 = step_profile.report(_h200_summary("fp32"))[1][0]
    assert fp32["roofline_ms_per_step"] == pytest.approx(48 * flops / 67e12 * 1e3) and fp32["bound_by"] == "matrix rate"
    # a GPU that is not modelled: measured only
    other = dict(_h200_summary("bf16"), device_name="NVIDIA A100-SXM4-80GB")
    assert all("roofline_ms_per_step" not in r for r in step_profile.report(other)[1])
