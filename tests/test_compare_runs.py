"""`vim-ds compare-runs` and what it relies on (`vim-ds train --init-weights/--save-init-weights`, the metrics.jsonl
header record): fast tests on fabricated metrics files and tiny models, then real runs on 2 CPU processes."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import torch

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, config, error_line, records, run_train, train_command, train_env
from vim_ds.cli import compare_runs
from vim_ds.engine.init_weights import load_init_weights, save_init_weights

HEADER = {"header": True, "start_step": 0, "global_batch": 16, "world_size": 2, "micro_batch": 8, "accum_steps": 1,
          "zero_stage": 3, "precision": "bf16", "seed": 0, "lr": 1e-3, "device_type": "cuda",
          "device_name": "AMD Instinct MI250X", "init_weights_sha256": "ab" * 32}


def write_run(directory, losses: dict, *, header=None, evals=(), lr=1e-3, summary_batch=None, extra_lines=()):
    """A metrics.jsonl as the trainer writes it: header, one record per step, evaluations, summary."""
    os.makedirs(directory, exist_ok=True)
    lines = [] if header is False else [json.dumps({**HEADER, **(header or {})})]
    for step, loss in sorted(losses.items()):
        lines.append(json.dumps({"step": step, "epoch": 0, "loss": loss, "lr": lr, "grad_norm": 1.0,
                                 "samples_per_sec": 10.0, "step_time": 0.1, "bad_images": 0}))
    for step, acc1 in evals:
        lines.append(json.dumps({"step": step, "epoch": 0, "eval_acc1": acc1, "eval_acc5": 90.0, "eval_loss": 1.0,
                                 "eval_images": 100, "eval_bad_images": 0}))
    if summary_batch:
        lines.append(json.dumps({"summary": True, "step": max(losses), "global_batch": summary_batch}))
    lines.extend(extra_lines)
    path = os.path.join(directory, "metrics.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(directory)


def curve(n=10, scale=1.0, start=1):
    return {s: scale * (2.3 - 0.1 * s) for s in range(start, start + n)}


def run_cli(capsys, *argv):
    code = compare_runs.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def with_options(directory, **options):
    """A run's options.yaml as `vim-ds train` writes it beside its metrics."""
    from vim_ds.config.options_file import write

    write(os.path.join(directory, "options.yaml"), {"model": "vim_tiny", "lr": 2e-3, "resume": "",
                                                    "deepspeed_config": "zero0", "output_dir": directory, **options})
    return directory


def test_options_that_do_not_change_what_a_run_computes_are_not_named(tmp_path, capsys):
    """Issue 50, item 16b: compare-runs named `--resume` as an option that differs, though it does not count (a
    resumed run's record does not count it either). The options that change how or where a run runs are left out;
    the variant: a shipped config's name and its path are one value. The control: --lr is still named."""
    from vim_ds.config.shipped_configs import resolve

    ref = with_options(write_run(tmp_path / "ref", curve()), num_workers=8)
    resumed = with_options(write_run(tmp_path / "resumed", curve()), resume="auto", num_workers=2, save_interval=5,
                           deepspeed_config=resolve("zero0"))
    other = with_options(write_run(tmp_path / "other", curve()), resume="auto", lr=4e-3)
    code, out, _ = run_cli(capsys, ref, resumed, other)
    assert code == 0
    lines = [line.strip() for line in out.splitlines() if "options that differ" in line]
    assert lines == ["options that differ: --lr 0.002 (reference) vs 0.004 (other)"], out


# -- verdicts ---------------------------------------------------------------------------------------------------

def test_runs_within_tolerance_exit_0_and_write_plot_csv_markdown(tmp_path, capsys):
    ref = write_run(tmp_path / "mi250", curve(), evals=[(10, 50.0)])
    new = write_run(tmp_path / "h100", curve(scale=1.001), evals=[(10, 51.5)],
                    header={"world_size": 1, "accum_steps": 2, "device_name": "NVIDIA H100 80GB HBM3"})
    code, out, err = run_cli(capsys, ref, new, "--out", tmp_path / "cmp")
    assert code == 0, (out, err)
    assert "h100 vs mi250: 10 common steps (1-10)" in out
    assert "loss: max rel diff 1.00e-03" in out and "mean 1.00e-03" in out
    assert "acc1 50.00 vs 51.50 (+1.50)" in out
    # what one compares is reported, not refused
    assert "world_size 2 vs 1" in out and "accum_steps 1 vs 2" in out and "NVIDIA H100" in out
    assert "verdict: within tolerance 0.01" in out
    assert out.strip().endswith("all 1 run(s) agree with mi250 within 0.01")
    for name in ("compare_runs.png", "compare_runs.csv", "compare_runs.md"):
        assert os.path.getsize(tmp_path / "cmp" / name) > 0, name
    rows = (tmp_path / "cmp" / "compare_runs.csv").read_text().splitlines()
    assert rows[0] == "step,mi250:loss,mi250:lr,h100:loss,h100:lr,h100:rel_diff" and len(rows) == 11
    assert "| `h100` | 10 (1-10) | 1.00e-03 (" in (tmp_path / "cmp" / "compare_runs.md").read_text()


def test_a_run_beyond_tolerance_exits_1_and_names_the_worst_step(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", curve())
    drift = curve()
    drift[7] *= 1.05
    ok = write_run(tmp_path / "ok", curve())
    bad = write_run(tmp_path / "bad", drift, lr=2e-3)
    code, out, _ = run_cli(capsys, ref, ok, bad, "--tolerance", "0.02")
    assert code == 1
    assert "loss: max rel diff 5.00e-02 (step 7:" in out
    assert "verdict: OUTSIDE tolerance 0.02" in out
    assert "the learning rates differ" in out
    assert out.strip().endswith("1 of 2 run(s) differ from ref beyond 0.02: bad")
    # the same runs pass a looser tolerance
    assert run_cli(capsys, ref, bad, "--tolerance", "0.06")[0] == 0


def test_runs_of_different_lengths_compare_over_common_steps(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", curve(10))
    # steps 4-15, far off after step 10: steps that only one run has do not count
    later = write_run(tmp_path / "later", {s: v * (1.3 if s > 10 else 1.0) for s, v in curve(12, start=4).items()})
    code, out, _ = run_cli(capsys, ref, os.path.join(later, "metrics.jsonl"))  # a metrics file works as well
    assert code == 0, out
    assert "later vs ref: 7 common steps (4-10); 3 only in ref, 5 only in later" in out


def test_non_finite_losses(tmp_path, capsys):
    """The trainer writes NaN as the string "nan": a step NaN in both runs agrees, NaN in one does not."""
    both = curve()
    both[3] = "nan"
    ref = write_run(tmp_path / "ref", both)
    assert run_cli(capsys, ref, write_run(tmp_path / "same", both))[0] == 0
    code, out, _ = run_cli(capsys, write_run(tmp_path / "fine", curve()), ref)
    assert code == 1 and "max rel diff inf (step 3" in out


def test_initial_weights_are_checked(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", curve())
    other = write_run(tmp_path / "other", curve(), header={"init_weights_sha256": "cd" * 32})
    unpinned = write_run(tmp_path / "unpinned", curve(), header={"init_weights_sha256": None})
    code, out, _ = run_cli(capsys, ref, other, unpinned)
    assert code == 0  # a warning: the losses decide
    assert "initial weights differ" in out
    assert "initial weights not pinned in unpinned" in out


# -- refusals: one line, exit 2 ---------------------------------------------------------------------------------

def assert_refused(capsys, argv, *words):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("vim-ds compare-runs: error: "), err
    for word in words:
        assert word in err, err


def test_runs_without_a_common_step_are_refused(tmp_path, capsys):
    assert_refused(capsys, [write_run(tmp_path / "a", curve(5)), write_run(tmp_path / "b", curve(5, start=6))],
                   "share no step", "steps 6-10")


def test_runs_with_another_global_batch_are_refused(tmp_path, capsys):
    ref = write_run(tmp_path / "a", curve())
    assert_refused(capsys, [ref, write_run(tmp_path / "b", curve(), header={"global_batch": 32})],
                   "global batch of 32", "16")
    # runs from before the header record: the summary's global batch is used
    old = write_run(tmp_path / "old", curve(), header=False, summary_batch=64)
    assert_refused(capsys, [ref, old], "global batch of 64")
    code, out, _ = run_cli(capsys, ref, write_run(tmp_path / "older", curve(), header=False))
    assert code == 0 and "global batch not recorded by older" in out


def test_missing_and_malformed_metrics_are_refused(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", curve())
    os.makedirs(tmp_path / "empty")
    assert_refused(capsys, [ref, tmp_path / "empty"], "no metrics.jsonl")
    assert_refused(capsys, [ref, tmp_path / "nothing.jsonl"], "no such file")
    garbled = write_run(tmp_path / "garbled", curve(), extra_lines=["{not json", json.dumps({"step": 99, "loss": 1})])
    assert_refused(capsys, [ref, garbled], "line 12", "not JSON")
    assert_refused(capsys, [ref, write_run(tmp_path / "text", curve(), extra_lines=['"text"'])], "not a JSON object")
    assert_refused(capsys, [ref, write_run(tmp_path / "nosteps", {})], "no training step")
    assert_refused(capsys, [ref, write_run(tmp_path / "badloss", {1: [1.0]})], "is not a number")


def test_a_line_being_written_is_not_an_error(tmp_path, capsys):
    """A live run's last line may be incomplete (no newline yet)."""
    live = write_run(tmp_path / "live", curve(5))
    with open(os.path.join(live, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "epoch": 0, "lo')
    code, out, _ = run_cli(capsys, write_run(tmp_path / "ref", curve()), live)
    assert code == 0 and "5 common steps (1-5)" in out


def test_usage_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        compare_runs.main([write_run(tmp_path / "only", curve())])
    assert exc.value.code == 2 and "at least two runs" in capsys.readouterr().err


def test_without_matplotlib_the_numbers_are_still_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = run_cli(capsys, write_run(tmp_path / "a", curve()), write_run(tmp_path / "b", curve()),
                             "--out", tmp_path / "cmp")
    assert code == 0
    assert err.strip() == "vim-ds compare-runs: compare_runs.png not written: matplotlib is missing " \
                          "(pip install matplotlib)"
    assert sorted(os.listdir(tmp_path / "cmp")) == ["compare_runs.csv", "compare_runs.md"]


def test_console_script_and_module_run_it(tmp_path, capsys):
    from vim_ds import cli

    a, b = write_run(tmp_path / "a", curve()), write_run(tmp_path / "b", curve(scale=1.5))
    assert cli.main(["compare-runs", a, b]) == 1 and "OUTSIDE" in capsys.readouterr().out
    proc = preloaded.run([sys.executable, "-m", "vim_ds.compare_runs", a, b], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)  # a hang guard only
    assert proc.returncode == 1 and "OUTSIDE" in proc.stdout, proc.stderr


# -- --init-weights / --save-init-weights -----------------------------------------------------------------------

def tiny_vim(seed: int, **kwargs):
    import timm

    torch.manual_seed(seed)
    args = dict(num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)
    return timm.create_model("vim_tiny", **{**args, **kwargs})


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_init_weights_round_trip_exactly_whatever_the_seed(tmp_path, suffix):
    path = str(tmp_path / f"init{suffix}")
    source = tiny_vim(seed=1)
    digest = save_init_weights(source, path, {"model": "vim_tiny", "model_kwargs": {}, "num_classes": 10,
                                              "input_size": 32, "step": 0})
    assert digest == hashlib.sha256(open(path, "rb").read()).hexdigest()
    target = tiny_vim(seed=2)  # another RNG draw, as another vendor's would be
    assert any(not torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    assert load_init_weights(target, path) == digest
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    if suffix == ".pth":  # the file is what `vim-ds convert` writes: --finetune, eval and predict read it too
        from vim_ds.checkpoint.convert import read_vim_ds_meta

        assert read_vim_ds_meta(path)["model"] == "vim_tiny"


def test_init_weights_of_another_model_are_refused(tmp_path):
    from vim_ds.checkpoint import CheckpointError

    path = str(tmp_path / "wide.pth")
    torch.save({"model": tiny_vim(0, embed_dim=48).state_dict()}, path)
    with pytest.raises(CheckpointError, match="does not match the model.*shape mismatch"):
        load_init_weights(tiny_vim(0), path)
    torch.save(tiny_vim(0, num_classes=1000).state_dict(), path)  # a bare state dict is read as well
    with pytest.raises(CheckpointError, match=r"head.weight: file \(1000, 32\) vs model \(10, 32\)"):
        load_init_weights(tiny_vim(0), path)
    torch.save({"model": {k: v for k, v in tiny_vim(0).state_dict().items() if k != "cls_token"}}, path)
    with pytest.raises(CheckpointError, match="missing: cls_token"):
        load_init_weights(tiny_vim(0), path)


INIT_META = {"model": "vim_tiny", "model_kwargs": {}, "num_classes": 10, "input_size": 32, "step": 0}


def test_save_init_weights_never_replaces_a_file_and_a_replay_of_options_yaml_is_refused(tmp_path):
    """The issue's case: `--save-init-weights f.pth` wrote over an existing file, and `vim-ds train --config
    OUT/options.yaml` (the run replayed) did it again. Refused before anything runs (the preflight of every rank),
    pointing to --init-weights, which starts from the very same weights; the file keeps its bytes."""
    from vim_ds.config import options_file
    from vim_ds.engine import preflight
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    init, out = tmp_path / "init.pth", tmp_path / "run"
    save_init_weights(tiny_vim(seed=1), str(init), INIT_META)  # the first run's
    before = init.read_bytes()
    argv = ["--data-set", "synthetic", "--nb-classes", "10", *TINY, "--output_dir", str(out), "--save-init-weights",
            str(init)]
    out.mkdir()
    options_file.write_run(str(out / options_file.OPTIONS_FILE),
                           options_file.record(RunConfig.from_dict(vars(parse_args(argv)))))
    for replay in (argv, ["--config", str(out / options_file.OPTIONS_FILE)]):
        with pytest.raises(ValueError) as refused:
            preflight.check(RunConfig.from_dict(vars(parse_args(replay))), is_main=True)
        assert str(refused.value) == (f"--save-init-weights {init} exists and is never replaced (runs that started "
                                      f"from it record its sha256): start from it with --init-weights {init}, or give "
                                      f"a new file name")
    assert init.read_bytes() == before


def test_the_initial_weights_writer_never_replaces_a_file_that_appears_meanwhile(tmp_path):
    """The variants, through the writer the trainer calls: a file already there, one that appears while the weights
    are written (the check before the write cannot see it: the hard link that puts the file in place refuses it),
    and a resumed run, which writes nothing (its initial weights were its first segment's)."""
    from vim_ds.checkpoint.convert import write_weights_file
    from vim_ds.checkpoint.files import CheckpointError
    from vim_ds.runtime import distributed
    from vim_ds.engine.init_weights import apply

    init = tmp_path / "init.pth"
    init.write_bytes(b"someone's file")
    with pytest.raises(CheckpointError, match="exists and is never replaced"):
        save_init_weights(tiny_vim(seed=1), str(init), INIT_META)
    assert init.read_bytes() == b"someone's file"

    late = tmp_path / "late.pth"
    with pytest.raises(CheckpointError, match=f"^cannot write {late}: File exists$"):
        write_weights_file(str(late), tiny_vim(seed=1).state_dict(), INIT_META, replace=False,
                           stall=lambda: late.write_bytes(b"written meanwhile"))
    assert late.read_bytes() == b"written meanwhile" and sorted(os.listdir(tmp_path)) == ["init.pth", "late.pth"]

    info = distributed.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    recorded = apply(tiny_vim(seed=2), INIT_META, info, save=str(init), resuming=True)
    assert init.read_bytes() == b"someone's file"
    assert recorded["init_weights_sha256"] == hashlib.sha256(b"someone's file").hexdigest()


def test_one_source_of_initial_weights_at_a_time():
    from vim_ds.cli.run_options import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--init-weights", "a.pth", "--finetune", "b.pth"])
    assert parse_args(["--save-init-weights", "a.pth"]).save_init_weights == "a.pth"


# -- real runs --------------------------------------------------------------------------------------------------

def digits_args(digits, out, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", str(out), "--num_workers", "0",
            "--seed", "3", *TINY, *QUIET_AUG, "--precision", "fp32", "--max-steps", "6", "--unscale-lr",
            "--warmup-epochs", "0", "--no-model-ema", *extra]


@pytest.mark.slow
def test_zero3_on_two_ranks_matches_one_rank_with_accumulation_and_another_lr_is_flagged(digits, tmp_path, capsys):
    """docs/clusters.md's example, for real: the reference (2 ranks, ZeRO-3) saves its initial weights; a run with
    another layout of the same global batch of 16 (1 rank, micro batch 8 x accumulation 2, ZeRO-0) starts from them
    and agrees to rounding; the same run with another learning rate (the negative control) is flagged."""
    init = tmp_path / "init.pth"
    ref, same, other_lr = tmp_path / "zero3_2ranks", tmp_path / "zero0_1rank_accum2", tmp_path / "lr4e-3"
    run_train(digits_args(digits, ref, "--deepspeed_config", config("zero3"), "--batch-size", "8", "--lr", "2e-3",
                          "--save-init-weights", init), nproc=2)
    # the two 1-rank runs side by side: most of a tiny run is start-up, which one core does as well as two
    procs = [preloaded.popen(train_command(digits_args(digits, out, "--deepspeed_config", config("zero0"),
                                                        "--batch-size", "8", "--accum-steps", "2", "--lr", lr,
                                                        "--init-weights", init)),
                             env=train_env({"OMP_NUM_THREADS": "1"}), cwd=ROOT)  # side by side: a thread each
             for out, lr in ((same, "2e-3"), (other_lr, "4e-3"))]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]

    digest = hashlib.sha256(init.read_bytes()).hexdigest()
    headers = {out.name: records(out)[0] for out in (ref, same, other_lr)}
    for name, h in headers.items():
        assert h["header"] and h["global_batch"] == 16 and h["precision"] == "fp32", (name, h)
        assert h["init_weights_sha256"] == digest, name
    assert (headers[ref.name]["world_size"], headers[ref.name]["zero_stage"]) == (2, 3)
    assert (headers[same.name]["world_size"], headers[same.name]["accum_steps"]) == (1, 2)
    assert headers[ref.name]["init_weights_mode"] == "saved" and headers[same.name]["init_weights_mode"] == "loaded"
    assert {"torch", "deepspeed", "timm", "vim_ds", "device_name", "seed"} <= headers[ref.name].keys()

    code, out, err = run_cli(capsys, ref, same)
    assert code == 0, out + err
    assert "6 common steps (1-6)" in out and "world_size 2 vs 1" in out
    code, out, err = run_cli(capsys, ref, same, other_lr, "--out", tmp_path / "cmp")
    assert code == 1, out + err
    assert out.strip().endswith(f"1 of 2 run(s) differ from {ref.name} beyond 0.01: {other_lr.name}")
    # margins: fp32 layouts agree to rounding (measured 5e-8), the control is far outside the default tolerance
    runs = [compare_runs.read_run(str(p), p.name) for p in (ref, same, other_lr)]
    assert compare_runs.compare(runs[0], runs[1], 0.01)["max_rel"] < 1e-6
    assert compare_runs.compare(runs[0], runs[2], 0.01)["max_rel"] > 0.015
    print(out)


@pytest.mark.slow
def test_train_refuses_init_weights_of_another_model_in_one_line(digits, tmp_path):
    path = tmp_path / "wide.pth"
    torch.save({"model": tiny_vim(0, embed_dim=48).state_dict()}, path)
    proc = run_train(digits_args(digits, tmp_path / "out", "--deepspeed_config", config("zero0"), "--batch-size", "8",
                                 "--init-weights", path), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert "--init-weights" in line and "does not match the model" in line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # nothing started
