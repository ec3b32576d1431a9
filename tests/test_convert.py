"""`vim-ds convert` and `vim-ds predict`: real 2-rank training runs (ZeRO-0 and ZeRO-3, fp32 and bf16) converted
to one weights file, loaded strictly into a fresh timm model, evaluated and used for predictions."""
from __future__ import annotations

import glob
import os
import shutil
import sys

import pytest
import torch

import preloaded
from train_utils import (CONFIG_STEPS, CPU_CONFIGS, QUIET_AUG, ROOT, TINY, config, config_run_args, evals,
                         rerecord_checksums, run_train)

TINY_KWARGS = dict(num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)


def cli(*args, check=True):
    proc = preloaded.run([sys.executable, "-m", "vim_ds.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"vim-ds {args[0]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error" in line]


def tiny_model():
    import timm

    import vim_ds.models  # noqa: F401

    return timm.create_model("vim_tiny", **TINY_KWARGS)


# -- no training needed ---------------------------------------------------------------------------------------

def test_convert_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = cli("convert", tmp_path, tmp_path / "out.pth", check=False)
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("vim-ds convert: error: "), proc.stderr
    assert str(tmp_path) in lines[0]
    assert not (tmp_path / "out.pth").exists()


def test_convert_and_predict_are_subcommands():
    from vim_ds.cli import SUBCOMMANDS

    assert SUBCOMMANDS["convert"][0] == "vim_ds.cli.convert" and SUBCOMMANDS["predict"][0] == "vim_ds.cli.predict"


# -- real training runs ---------------------------------------------------------------------------------------

RUNS = {"zero0_fp32": ("zero0", "fp32"), "zero3_fp32": ("zero3", "fp32"), "zero0_bf16": ("zero0", "bf16"),
        "zero2_bf16": ("zero2", "bf16"), "zero3_bf16": ("zero3", "bf16")}
# lr 2e-3 as it is (not batch-scaled to 6.25e-5): 3 Adam steps move the weights by ~6e-3, far above the
# comparisons' tolerances below (the scaled lr moved them by ~2e-4, 100x under the old 2e-2 bound)
LR = ["--lr", "2e-3", "--unscale-lr"]


def initial_weights(bf16: bool) -> dict:
    """The weights every run starts from (the trainer seeds 3 before building the model); a bf16 run's fp32
    masters start from them rounded to bf16. The negative control: an unconverted/never-trained state."""
    torch.manual_seed(3)
    state = tiny_model().state_dict()
    return {k: (v.bfloat16().float() if bf16 else v) for k, v in state.items()}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)




@pytest.fixture(scope="module")
def runs(digits, tmp_path_factory, config_run):
    out = {}
    for name, (cfg, precision) in RUNS.items():
        if precision == "fp32":  # the shared run of that config (the same recipe, plus a checkpoint every step)
            out[name] = config_run(cfg)
            continue
        d = str(tmp_path_factory.mktemp(name))
        run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", d, "--num_workers", "0",
                   "--seed", "3", *TINY, *QUIET_AUG, "--deepspeed_config", config(cfg), "--precision", precision,
                   "--batch-size", 8, "--max-steps", 3, *LR, "--warmup-epochs", "0",
                   "--model-ema-decay", "0.8"], nproc=2)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def converted(runs, tmp_path_factory):
    d = tmp_path_factory.mktemp("converted")
    from vim_ds.checkpoint.convert import convert

    files = {}
    for name, run in runs.items():
        files[name] = str(d / f"{name}.pth")
        if name == "zero3_fp32":  # through the CLI once; in-process for the others (one DeepSpeed import)
            proc = cli("convert", os.path.join(run, "checkpoints"), files[name])
            assert proc.stdout.startswith("wrote ") and len(proc.stdout.strip().splitlines()) == 1, proc.stdout
        else:
            assert convert(os.path.join(run, "checkpoints"), files[name])["step"] == 3
    return files


def tag_dir(run):
    return os.path.join(run, "checkpoints", "global_step3")


@pytest.mark.slow
def test_converted_files_load_strictly_into_a_fresh_timm_model(converted):
    for name, path in converted.items():
        obj = torch.load(path, map_location="cpu", weights_only=True)  # plain types only
        assert set(obj) == {"model", "model_ema", "vim_ds"}, name
        meta = obj["vim_ds"]
        assert meta["model"] == "vim_tiny" and meta["num_classes"] == 10 and meta["input_size"] == 32
        assert meta["model_kwargs"] == {"depth": 2, "embed_dim": 32, "patch_size": 4, "stride": 4}
        assert meta["step"] == 3 and f"zero{meta['zero_stage']}" == RUNS[name][0]
        assert meta["precision"] == RUNS[name][1]
        assert all(v.dtype == torch.float32 for v in obj["model"].values())
        model = tiny_model()
        model.load_state_dict(obj["model"], strict=True)
        model.load_state_dict(obj["model_ema"], strict=True)


@pytest.mark.slow
def test_zero0_and_zero3_give_the_same_weights(converted):
    a = torch.load(converted["zero0_fp32"], weights_only=True)["model"]
    b = torch.load(converted["zero3_fp32"], weights_only=True)["model"]
    assert a.keys() == b.keys()
    worst = max_abs_diff(a, b)
    assert worst <= 1e-6, worst
    # negative control: the untrained weights are far outside (the weights moved by >= 10x the tolerance)
    assert max_abs_diff(initial_weights(bf16=False), a) >= 10 * 1e-6


@pytest.mark.slow
def test_bf16_zero0_conversion_keeps_the_fp32_masters(runs, converted):
    module = torch.load(os.path.join(tag_dir(runs["zero0_bf16"]), "mp_rank_00_model_states.pt"),
                        weights_only=False)["module"]
    masters = torch.load(converted["zero0_bf16"], weights_only=True)["model"]
    assert module.keys() == masters.keys()
    assert all(module[k].dtype == torch.bfloat16 for k in module)
    # the masters round to the bf16 module weights, and carry more precision than them
    assert all(torch.equal(masters[k].bfloat16(), module[k]) for k in module)
    assert any(not torch.equal(masters[k], module[k].float()) for k in module)


@pytest.mark.slow
def test_bf16_zero2_conversion_reads_the_partitioned_fp32_masters(runs, converted):
    tag = tag_dir(runs["zero2_bf16"])
    assert len(glob.glob(os.path.join(tag, "bf16_zero_pp_rank_*_optim_states.pt"))) == 2
    module = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    masters = torch.load(converted["zero2_bf16"], weights_only=True)["model"]
    assert module.keys() == masters.keys() and all(v.dtype == torch.float32 for v in masters.values())
    assert all(torch.equal(masters[k].bfloat16(), module[k].bfloat16()) for k in module)
    assert any(not torch.equal(masters[k], module[k].float()) for k in module)
    # the same training as ZeRO-3 bf16 (the same DeepSpeed ZeRO optimizer; ZeRO-0 bf16 runs DeepSpeed's other bf16
    # optimizer, whose trajectory differs by ~20 % of the movement, see test_train.py), up to summation order:
    # measured bit-identical here (fp32 ZeRO-0 vs ZeRO-3: 2.4e-7); the weights moved by 6.1e-3 in 3 steps
    ref = torch.load(converted["zero3_bf16"], weights_only=True)["model"]
    tolerance = 1e-6
    assert max_abs_diff(ref, masters) <= tolerance
    # negative controls, each >= 10x outside: the untrained weights (a conversion of nothing), and the bf16 module
    # weights (a conversion that ignored the fp32 masters)
    assert max_abs_diff(initial_weights(bf16=True), ref) >= 10 * tolerance
    assert max_abs_diff({k: module[k].float() for k in module}, ref) >= 10 * tolerance


@pytest.mark.slow
def test_ema_flag_and_safetensors_round_trip(runs, converted, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    run = runs["zero3_fp32"]
    ema = torch.load(os.path.join(tag_dir(run), "ema.pt"), weights_only=True)
    ema_pth = tmp_path / "ema.pth"
    cli("convert", os.path.join(run, "checkpoints"), ema_pth, "--ema", "--tag", "global_step3")
    obj = torch.load(ema_pth, weights_only=True)
    assert "model_ema" not in obj and obj["vim_ds"]["weights"] == "ema"
    assert all(torch.equal(obj["model"][k], ema[k].float()) for k in ema) and obj["model"].keys() == ema.keys()

    from vim_ds.checkpoint.convert import convert

    st = tmp_path / "model.safetensors"
    summary = convert(os.path.join(run, "checkpoints"), st)
    assert summary["format"] == "safetensors" and summary["tensors"] == len(ema)
    weights = load_file(str(st))
    ref = torch.load(converted["zero3_fp32"], weights_only=True)["model"]
    assert weights.keys() == ref.keys() and all(torch.equal(weights[k], ref[k]) for k in ref)
    with safe_open(str(st), framework="pt") as f:
        md = f.metadata()
    import json

    assert md["format"] == "vim_ds" and md["model"] == "vim_tiny"
    assert json.loads(md["config"]) == {"model_kwargs": {"depth": 2, "embed_dim": 32, "patch_size": 4, "stride": 4},
                                        "num_classes": 10, "input_size": 32}
    tiny_model().load_state_dict(weights, strict=True)

    st_ema = tmp_path / "ema.bin"
    convert(os.path.join(run, "checkpoints"), st_ema, ema=True, safetensors=True)
    assert all(torch.equal(load_file(str(st_ema))[k], ema[k].float()) for k in ema)


@pytest.mark.slow
def test_errors_missing_rank_file_and_missing_ema(runs, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(os.path.join(runs["zero3_fp32"], "checkpoints"), copy)
    victim = glob.glob(str(copy / "global_step3" / "*zero_pp_rank_1_*optim_states.pt"))
    assert len(victim) == 1
    os.remove(victim[0])
    proc = cli("convert", copy, tmp_path / "out.pth", check=False)
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    # the completion marker's file list names what is missing before DeepSpeed's reader is reached
    assert lines[0].startswith("vim-ds convert: error: ") and "cannot be used" in lines[0] and "is missing" in lines[0]
    assert os.path.basename(victim[0]) in lines[0]
    assert not (tmp_path / "out.pth").exists()

    no_ema = tmp_path / "no_ema"
    shutil.copytree(os.path.join(runs["zero0_fp32"], "checkpoints"), no_ema)
    os.remove(no_ema / "global_step3" / "ema.pt")
    rerecord_checksums(no_ema / "global_step3")  # as a run without EMA writes it
    proc = cli("convert", no_ema, tmp_path / "out.pth", "--ema", check=False)
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "no EMA weights" in lines[0], proc.stderr


@pytest.mark.slow
def test_eval_of_the_converted_file_matches_the_training_runs_final_eval(runs, converted, digits, tmp_path):
    run = runs["zero3_fp32"]
    final = evals(run)[-1]
    out = str(tmp_path / "eval")
    run_train(["--data-set", "folder", "--data-path", digits, "--output_dir", out, "--num_workers", "0", *TINY,
               "--precision", "fp32", "--resume", converted["zero3_fp32"]], nproc=1, module="vim_ds.eval")
    record = evals(out)[-1]
    assert record["eval_acc1"] == pytest.approx(final["eval_acc1"], abs=1e-9)
    assert record["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-4)
    assert record["ema_eval_acc1"] == pytest.approx(final["ema_eval_acc1"], abs=1e-9)


@pytest.mark.slow
def test_predict_prints_five_class_names_per_image(converted, digits):
    images = [sorted(glob.glob(os.path.join(digits, "val", c, "*.png")))[0] for c in ("3", "7")]
    proc = cli("predict", "--weights", converted["zero0_fp32"], "--classes", os.path.join(digits, "train"), *images)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    classes = set(os.listdir(os.path.join(digits, "train")))
    for image, line in zip(images, lines):
        path, top = line.split(": ", 1)
        assert path == image
        entries = [e.rsplit(" ", 1) for e in top.split(", ")]
        assert len(entries) == 5 and all(name in classes for name, _ in entries), line
        probs = [float(p) for _, p in entries]
        assert probs == sorted(probs, reverse=True) and all(0 <= p <= 1 for p in probs)


def engine_logits(run: str, name: str, digits, out, *extra) -> torch.Tensor:
    """The logits of tests/engine_logits.py's fixed batch from the 2-rank engine of ds_configs/NAME.json, restored
    from the run's newest checkpoint by DeepSpeed's load_checkpoint (extra: more trainer arguments, e.g. the
    run's --precision)."""
    args = config_run_args(digits, os.path.dirname(out), name, *extra, "--resume", os.path.join(run, "checkpoints"))
    proc = preloaded.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          os.path.join(ROOT, "tests", "engine_logits.py"), *map(str, args)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "LOGITS_OUT": str(out), "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


def file_logits(path) -> torch.Tensor:
    model = tiny_model().eval()
    model.load_state_dict(torch.load(path, weights_only=True)["model"], strict=True)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        return model(x)


# Measured on 2 CPU cores (fp32): the converted file's logits equal the engine's exactly for every config; the
# step-2 file's differ from the step-3 engine's by 9.8e-2. The converted weights are the engine's fp32 weights bit
# for bit, so only the order of the sums inside the forward may differ (another thread count or kernel blocking,
# e.g. on another machine): a few ulps of logits of magnitude ~1, i.e. ~1e-6; the tolerance is 10x that and the
# control ~1e4x above it.
LOGITS_TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_converted_model_gives_the_logits_of_the_deepspeed_engine(config_run, digits, tmp_path, name):
    """Every stage, offloaded or not: the 2-rank engine restored by DeepSpeed's load_checkpoint and the file
    `vim-ds convert` wrote from the same checkpoint give the same logits."""
    run = config_run(name)
    engine = engine_logits(run, name, digits, tmp_path / "logits.pt")
    path = tmp_path / "converted.pth"
    proc = cli("convert", os.path.join(run, "checkpoints"), path)
    assert proc.stdout.startswith("wrote ") and len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    meta = torch.load(path, weights_only=True)["vim_ds"]
    assert meta["step"] == CONFIG_STEPS and f"zero{meta['zero_stage']}" == name.split("_")[0], meta
    logits = file_logits(path)
    assert logits.shape == engine.shape == (4, 10)
    worst = (logits - engine).abs().max().item()
    print(f"{name}: converted vs engine logits differ by {worst:.3g}")
    assert worst <= LOGITS_TOLERANCE, worst
    # negative control: the previous step's checkpoint (a conversion that read a stale tag, or weights one Adam step
    # off) is >= 10x outside the tolerance
    from vim_ds.checkpoint.convert import convert

    stale = tmp_path / "stale.pth"
    convert(os.path.join(run, "checkpoints"), stale, tag=f"global_step{CONFIG_STEPS - 1}")
    off = (file_logits(stale) - engine).abs().max().item()
    print(f"{name}: the step-{CONFIG_STEPS - 1} file's logits differ by {off:.3g}")
    assert off >= 10 * LOGITS_TOLERANCE, off


@pytest.mark.slow
def test_bench_convert_reports_memory_and_the_verification_of_every_checkpoint_file(config_run, tmp_path):
    """`vim-ds bench convert --checkpoint RUN` on the shared ZeRO-3 run: the conversion's peak memory, and the time
    to verify the checkpoint as resume, eval and convert do, over exactly the bytes of its files (the marker
    aside). Control: a copy with one byte of a file changed is refused, naming the file."""
    import json

    from vim_ds.checkpoint.deepspeed_dir import MARKER

    run = config_run("zero3")
    tag_dir = os.path.join(run, "checkpoints", f"global_step{CONFIG_STEPS}")
    on_disk = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(tag_dir)
                  for name in names if name != MARKER)
    report = tmp_path / "bench.json"
    proc = preloaded.run([sys.executable, "-m", "vim_ds.cli", "bench", "convert", "--checkpoint", run,
                           "--json", report], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["verified_bytes"] == on_disk > 0 and 0 < result["verify_seconds"] < 60, result
    assert result["source"] == tag_dir and result["peak_bytes"] >= result["floor_bytes"] > 0, result
    assert "checkpoint verification" in proc.stdout and f"{on_disk / 2**30:.2f} GiB" in proc.stdout, proc.stdout

    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged, ignore=shutil.ignore_patterns(".vim_ds.lock"))
    victim = sorted(glob.glob(str(damaged / "checkpoints" / f"global_step{CONFIG_STEPS}" / "*model_states.pt")))[0]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = preloaded.run([sys.executable, "-m", "vim_ds.cli", "bench", "convert", "--checkpoint", damaged],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and os.path.basename(victim) in proc.stderr, proc.stderr[-2000:]
