"""torch.compile on Vim: no graph breaks in any published variant, the same loss and gradients as eager, and
`vim-ds train --compile` through DeepSpeed's engine.compile() with the eager run's per-step losses.

Inductor compiles C++ kernels with g++: about 2 minutes for a 2-block Vim on a busy 2-core CPU when its cache is
cold, so the equality tests use the aot_eager backend (Dynamo + AOT autograd + the ops' fake implementations and
registered autograd, i.e. everything torch.compile needs from the model and the ops); inductor itself is tested in
one slow test.
"""
import pytest
import timm
import torch
import torch.nn.functional as F

import vim_ds  # noqa: F401
from train_utils import QUIET_AUG, TINY, config, rel_diff, run_train, step_losses
from vim_ds.models.vim import VARIANTS


def tiny_vim(**kw):
    torch.manual_seed(0)
    args = dict(num_classes=10, img_size=32, depth=2, embed_dim=32, patch_size=16, stride=8, drop_path_rate=0.0)
    return timm.create_model("vim_tiny", **{**args, **kw})


def loss_and_grads(model, fn):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    loss = F.cross_entropy(fn(x), torch.tensor([1, 7]))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager_step():
    """The eager loss and gradients of tiny_vim() (deterministic: seed 0), computed once for every compile test."""
    model = tiny_vim()
    return loss_and_grads(model, model)


def assert_same_training_step(model, compiled, eager_step):
    loss_e, grads_e = eager_step
    loss_c, grads_c = loss_and_grads(model, compiled)
    assert abs(loss_c - loss_e) <= 1e-5 * abs(loss_e)
    for name, g in grads_e.items():
        assert (grads_c[name] - g).norm() <= 1e-5 * g.norm() + 1e-12, name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_no_graph_breaks_in_any_published_variant(name):
    """The published architectures (depth reduced, small images): one graph, training and inference mode."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, img_size=32, depth=1)
    x = torch.randn(2, 3, 32, 32)
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


def test_fullgraph_compile_gives_eager_loss_and_gradients(eager_step):
    model = tiny_vim()
    torch._dynamo.reset()
    assert_same_training_step(model, torch.compile(model, fullgraph=True, backend="aot_eager"), eager_step)


@pytest.mark.slow
def test_fullgraph_inductor_compile_gives_eager_loss_and_gradients(eager_step):
    model = tiny_vim()
    torch._dynamo.reset()
    assert_same_training_step(model, torch.compile(model, fullgraph=True), eager_step)


# -- vim-ds train --compile --------------------------------------------------------------------------------------

def train_args(digits, out, stage, *extra):
    return ["--data-set", "folder", "--data-path", digits, "--output_dir", out, "--num_workers", "0", "--seed", "3",
            *TINY, *QUIET_AUG, "--deepspeed_config", config(f"zero{stage}"), "--precision", "fp32",
            "--batch-size", "8", "--max-steps", "3", "--epochs", "1", "--lr", "2e-3", "--unscale-lr",
            "--warmup-epochs", "0", "--no-model-ema", *extra]


@pytest.fixture(scope="module")
def eager_losses(digits, tmp_path_factory):
    # fp32 losses of ZeRO 0-3 agree to ~1e-7 (tests/test_train.py), so one eager run is the reference for all
    out = str(tmp_path_factory.mktemp("eager"))
    run_train(train_args(digits, out, 0), nproc=2)
    return step_losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_compile_gives_the_eager_losses(stage, eager_losses, digits, tmp_path):
    """Compiled by engine.compile() (aot_eager: inductor's g++ builds would not fit the time), against the eager
    2-rank losses: ZeRO-2 on 2 ranks (DeepSpeed's gradient hooks and gloo collectives around the compiled model), the
    other stages on 1 rank with 2 accumulation steps, the same global batch (in fp32 1 rank x 2 gives the 2 ranks'
    losses to ~1e-7, tests/test_train.py): each rank compiles the model itself, so a second rank costs a second
    compile. The tiny model's parameters are below zero3.json's persistence threshold, so 2 ranks would partition
    nothing more under ZeRO-3."""
    out = str(tmp_path / f"compiled{stage}")
    nproc, split = (2, []) if stage == 2 else (1, ["--accum-steps", "2"])
    run_train(train_args(digits, out, stage, "--compile", "--compile-backend", "aot_eager", *split), nproc=nproc)
    assert rel_diff(step_losses(out), eager_losses) <= 1e-6


@pytest.mark.slow
def test_train_compile_failure_is_one_line(digits, tmp_path):
    """A compiler DeepSpeed cannot use: one line naming the configuration, exit 2, no traceback."""
    proc = run_train(train_args(digits, str(tmp_path / "bad"), 0, "--compile", "--compile-backend", "no_such"),
                     nproc=1, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("vim-ds train: error")]
    assert line and "--compile" in line[0] and "ZeRO-0" in line[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
