"""The trainer's parts on their own (no process group): optimizer groups, the per-step schedule, EMA arithmetic,
finding the checkpoint to resume, command-line parsing."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

import vim_ds  # noqa: F401
from vim_ds.checkpoint import deepspeed_dir
from vim_ds.checkpoint.files import CheckpointError
from vim_ds.engine.ema import ShardedEMA
from vim_ds.engine.optim import PerStepScheduler, scaled_lr
from vim_ds.models import param_groups


def tiny_vim():
    import timm

    return timm.create_model("vim_tiny", num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=4, stride=4)


def test_weight_decay_groups_follow_the_recipe():
    model = tiny_vim()
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert len(no_decay_names) + len(decay_names) == len(names)
    for name in ("pos_embed", "cls_token", "layers.0.mixer.A_log", "layers.0.mixer.A_b_log", "layers.0.mixer.D",
                 "layers.1.mixer.D_b", "layers.0.norm.weight", "norm_f.weight", "head.bias",
                 "layers.0.mixer.dt_proj.bias"):
        assert name in no_decay_names, name
    for name in ("patch_embed.proj.weight", "layers.0.mixer.in_proj.weight", "layers.0.mixer.x_proj_b.weight",
                 "layers.1.mixer.out_proj.weight", "head.weight"):
        assert name in decay_names, name


def test_lr_is_scaled_by_global_batch_over_512():
    assert scaled_lr(5e-4, 1024) == pytest.approx(1e-3)
    assert scaled_lr(5e-4, 1024, unscale=True) == 5e-4


def test_schedule_warms_up_linearly_then_follows_the_cosine_to_min_lr_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = PerStepScheduler(opt, total_steps=100, warmup_steps=10, warmup_lr=1e-6, min_lr=1e-5)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(100):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(1e-6)
    assert lrs[5] == pytest.approx(1e-6 + 5 * (1e-3 - 1e-6) / 10)
    # after warmup: timm's cosine over the whole run (DeiT's schedule), evaluated at the step index
    for t in (10, 37, 99):
        assert lrs[t] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * t / 100)))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == pytest.approx(1e-5)
    # resuming the scheduler puts the lr back where it was
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    again = PerStepScheduler(opt2, total_steps=100, warmup_steps=10, warmup_lr=1e-6, min_lr=1e-5)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == [pytest.approx(lrs[100])]


def test_ema_is_the_exponential_average_and_round_trips():
    model = torch.nn.Linear(3, 2)
    ema = ShardedEMA(model, decay=0.9)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = {n: v.clone() for n, v in start.items()}
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        for n, p in model.named_parameters():
            expected[n] = 0.9 * expected[n] + 0.1 * p.detach()
    full = ema.full_state_dict()
    for n in expected:
        torch.testing.assert_close(full[n], expected[n])
    other = ShardedEMA(torch.nn.Linear(3, 2), decay=0.9)
    other.load_full_state_dict(full)
    for n, v in other.full_state_dict().items():
        torch.testing.assert_close(v, full[n])
    with pytest.raises(KeyError):
        other.load_full_state_dict({})


def _fake_tag(save_dir, tag, step, complete=True):
    path = os.path.join(save_dir, tag)
    os.makedirs(path)
    open(os.path.join(path, "mp_rank_00_model_states.pt"), "wb").close()
    if complete:
        with open(os.path.join(path, deepspeed_dir.MARKER), "w") as f:
            json.dump({"step": step}, f)
    return path


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    save = str(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        deepspeed_dir.resolve(save)
    _fake_tag(save, "global_step5", 5)
    _fake_tag(save, "global_step10", 10)
    interrupted = _fake_tag(save, "global_step15", 15, complete=False)
    deepspeed_dir.write_atomic(os.path.join(save, "latest"), "global_step15")  # what an interrupted save leaves
    assert deepspeed_dir.resolve(save) == (save, "global_step10")
    deepspeed_dir.write_atomic(os.path.join(save, "latest"), "global_step5")
    assert deepspeed_dir.resolve(save) == (save, "global_step5")  # `latest` is honoured when it is complete
    assert deepspeed_dir.resolve(os.path.join(save, "global_step10")) == (save, "global_step10")
    with pytest.raises(CheckpointError, match="incomplete"):
        deepspeed_dir.resolve(interrupted)
    with pytest.raises(CheckpointError, match="not found"):
        deepspeed_dir.resolve(str(tmp_path / "missing"))


def test_command_line_follows_the_published_names():
    from vim_ds.cli.run_options import parse_args

    args = parse_args(["--model", "vim_small", "--model-kwargs", "depth=4", "embed_dim=64", "name=x",
                       "--batch-size", "32", "--no-model-ema", "--no-repeated-aug", "--local_rank", "3",
                       "--deepspeed_config", "ds_configs/zero1.json", "--output_dir", "o", "--num_workers", "2"])
    assert args.model_kwargs == {"depth": 4, "embed_dim": 64, "name": "x"}
    assert args.batch_size == 32 and args.model_ema is False and args.repeated_aug is False
    assert args.local_rank == 3 and args.deepspeed_config == "ds_configs/zero1.json"
    defaults = parse_args([])
    assert (defaults.lr, defaults.min_lr, defaults.warmup_lr, defaults.weight_decay) == (5e-4, 1e-5, 1e-6, 0.05)
    assert (defaults.mixup, defaults.cutmix, defaults.smoothing, defaults.reprob) == (0.8, 1.0, 0.1, 0.25)
    assert defaults.aa == "rand-m9-mstd0.5-inc1" and defaults.model_ema_decay == 0.99996
    assert defaults.model_ema and defaults.repeated_aug and defaults.batch_size is None
    with pytest.raises(SystemExit):
        parse_args(["--model-kwargs", "depth"])


@pytest.mark.parametrize("option,value,cause", [("--max-bad-steps", "0", "at least 1"),
                                                ("--max-bad-images", "2", "between 0 and 1"),
                                                ("--dist-timeout", "0", "positive number of seconds"),
                                                ("--data-timeout", "600", "below --dist-timeout"),
                                                ("--num_workers", "-1", "0 or more")])
def test_fault_tolerance_options_are_checked(option, value, cause, capsys):
    from vim_ds.cli.run_options import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args([option, value])
    assert exit_info.value.code == 2
    assert cause in capsys.readouterr().err
    args = parse_args([])
    assert (args.max_bad_steps, args.max_bad_images, args.dist_timeout) == (1, 0.01, 600)
    assert args.data_timeout == 120 and parse_args(["--dist-timeout", "60"]).data_timeout == 30


def test_a_cpu_rank_takes_its_share_of_the_cores_it_may_run_on(monkeypatch):
    """Ranks on one host split the cores their affinity allows (taskset, cpuset, SLURM's binding), not os.cpu_count()
    (every core of the machine): oversubscribed OpenMP threads spin and waste CPU."""
    from vim_ds.runtime.distributed import cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert [cpu_threads(n) for n in (1, 2, 4, 8)] == [6, 3, 1, 1]


DYNAMO_OFF = r'''
import os, sys
import torch
from vim_ds.runtime.deepspeed_engine import _dynamo_off

with _dynamo_off(True):
    import deepspeed.runtime.zero.muon.muon_optimizer  # what deepspeed.initialize imports for ZeRO 1-3
inside = "torch._inductor.compile_fx" in sys.modules
restored = "TORCHDYNAMO_DISABLE" not in os.environ
torch.compile(lambda x: x + 1)  # the control: the same call with TorchDynamo on imports it
print("RESULT", inside, restored, "torch._inductor.compile_fx" in sys.modules)
'''


def test_deepspeed_builds_a_run_without_compile_with_dynamo_off_and_puts_it_back():
    """Without --compile, `deepspeed.initialize` runs with TorchDynamo off: DeepSpeed's Muon module (imported for
    ZeRO 1-3) then does not pull in torch._inductor's compiler (about a CPU-second of every rank's start-up), and
    the environment is as it was afterwards. A fresh process: the suite's forked ones have it imported already."""
    import subprocess
    import sys

    from vim_ds.runtime.deepspeed_engine import _dynamo_off

    proc = subprocess.run([sys.executable, "-c", DYNAMO_OFF], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert line.split()[1:] == ["False", "True", "True"], line
    # with --compile, and where the user set it, nothing is changed
    with _dynamo_off(False):
        assert "TORCHDYNAMO_DISABLE" not in os.environ
    os.environ["TORCHDYNAMO_DISABLE"] = "0"
    try:
        with _dynamo_off(True):
            assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
        assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]


def test_a_free_port_comes_from_below_the_ephemeral_range_and_binds():
    """vim_ds's MASTER_PORTs (single process, bench and zero-compare runs, launch/single_node.sh) come from below
    the ephemeral range, where no outgoing connection can take them before the master binds. Control: the kernel's
    own choice (port 0), what every picker used before, lands inside that range."""
    import socket

    from vim_ds.runtime.ports import LOWEST, ephemeral_low, free_port

    ports = [free_port() for _ in range(20)]
    assert all(LOWEST <= p < ephemeral_low() for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free, as said
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= ephemeral_low()
