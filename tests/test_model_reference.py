"""vim_ds models against an independent re-implementation of the published Vim forward pass (tests/published_vim.py).

The oracle is checked first against itself (conv vs torch's conv1d, recurrence vs closed form, direction and flip
structure), then vim_ds is checked against it: state-dict layout of every published variant, logits for every
variant family with random weights in float64 and float32, published-format checkpoint round trips, and a single
mixer from the equations. CPU only; reduced depth and image size for everything that runs a forward pass.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
if str(_HERE.parent) not in sys.path:  # fall back to the checkout when vim_ds is not installed
    sys.path.append(str(_HERE.parent))

import published_vim as pv  # noqa: E402

F64 = torch.float64
F32 = torch.float32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, computed in float64."""
    a, b = a.detach().to(F64), b.detach().to(F64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.fixture(scope="module")
def timm_vim():
    import timm

    import vim_ds  # noqa: F401  (registers the Vim variants with timm)

    return timm


def create(timm, name: str, cfg: pv.VimConfig, drop_path_rate: float = 0.1):
    return timm.create_model(name, num_classes=cfg.num_classes, img_size=cfg.img_size,
                             depth=cfg.depth, drop_path_rate=drop_path_rate)


def load_published(model, sd, dtype):
    """Load a published-format state dict strictly and put the model in eval mode in ``dtype``."""
    model = model.double() if dtype == F64 else model.float()
    missing_unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    assert not missing_unexpected.missing_keys and not missing_unexpected.unexpected_keys
    return model.eval()


def images(cfg: pv.VimConfig, batch: int, seed: int, dtype=F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g, dtype=F64).to(dtype)


# ================================================================================================================
# 0. The oracle checked against itself (no vim_ds)
# ================================================================================================================

def test_oracle_self_causal_conv_matches_torch_conv1d():
    g = torch.Generator().manual_seed(0)
    E, L = 12, 9
    x = torch.randn(3, E, L, generator=g, dtype=F64)
    w = torch.randn(E, 1, 4, generator=g, dtype=F64)
    b = torch.randn(E, generator=g, dtype=F64)
    ref = F.conv1d(x, w, b, padding=3, groups=E)[..., :L]  # how the published nn.Conv1d path does it
    assert rel_err(pv.causal_depthwise_conv1d(x, w, b), ref) < 1e-14
    # L shorter than the kernel
    assert rel_err(pv.causal_depthwise_conv1d(x[..., :2], w, b),
                   F.conv1d(x[..., :2], w, b, padding=3, groups=E)[..., :2]) < 1e-14


def test_oracle_self_softplus_silu():
    x = torch.linspace(-40, 40, 1001, dtype=F64)
    lo = x <= 20  # torch (and the CUDA kernel) return x itself above 20: a 1e-10 relative difference
    assert rel_err(pv.softplus(x[lo]), F.softplus(x[lo])) < 1e-14
    assert rel_err(pv.softplus(x[~lo]), F.softplus(x[~lo])) < 1e-9
    assert rel_err(pv.silu(x), F.silu(x)) < 1e-14


def _scan_inputs(seed, batch=2, E=6, N=5, L=11):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return dict(u=r(batch, E, L), delta=r(batch, E, L), A=-torch.exp(r(E, N)), B=r(batch, N, L), C=r(batch, N, L),
                D=r(E), z=r(batch, E, L), delta_bias=r(E))


def test_oracle_self_scan_recurrence_matches_closed_form():
    kw = _scan_inputs(1)
    for extra in (dict(delta_softplus=True), dict(delta_softplus=False, D=None, z=None, delta_bias=None)):
        args = {**kw, **extra}
        if not extra.get("delta_softplus", True):
            args["delta"] = args["delta"].abs()
        assert rel_err(pv.selective_scan_naive(**args), pv.selective_scan_quadratic(**args)) < 1e-12


def test_oracle_self_scan_single_step_by_hand():
    kw = _scan_inputs(2, L=1)
    d = F.softplus(kw["delta"] + kw["delta_bias"][None, :, None])                         # (b, E, 1)
    h = d[..., 0, None] * kw["B"][:, None, :, 0] * kw["u"][..., 0, None]                 # (b, E, N)
    y = (h * kw["C"][:, None, :, 0]).sum(-1, keepdim=True) + kw["D"][None, :, None] * kw["u"]
    y = y * torch.sigmoid(kw["z"]) * kw["z"]
    assert rel_err(pv.selective_scan_naive(**kw, delta_softplus=True), y) < 1e-14


def test_oracle_self_scan_matches_vim_ds_reference_scan():
    from vim_ds.ops.selective_scan_ref import selective_scan_ref

    kw = _scan_inputs(3)
    assert rel_err(pv.selective_scan_naive(**kw, delta_softplus=True),
                   selective_scan_ref(**kw, delta_softplus=True)) < 1e-13


def _mixer_sd(cfg, seed):
    sd = pv.random_state_dict(cfg, seed)
    return {k: v for k, v in sd.items() if k.startswith("layers.0.mixer.")}


def test_oracle_self_mixer_flip_symmetry():
    """With the backward-direction weights set equal to the forward ones, mixer(flip(x)) == flip(mixer(x)):
    checks that x AND z are flipped for the backward scan and its output flipped back."""
    cfg = pv.VimConfig(embed_dim=32, depth=1)
    sd = _mixer_sd(cfg, 4)
    p = "layers.0.mixer."
    for a, b in (("A_log", "A_b_log"), ("D", "D_b"), ("conv1d.weight", "conv1d_b.weight"),
                 ("conv1d.bias", "conv1d_b.bias"), ("x_proj.weight", "x_proj_b.weight"),
                 ("dt_proj.weight", "dt_proj_b.weight"), ("dt_proj.bias", "dt_proj_b.bias")):
        sd[p + b] = sd[p + a].clone()
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(5), dtype=F64)
    y = pv.bimamba_v2_mixer(sd, p, x)
    y_flip = pv.bimamba_v2_mixer(sd, p, x.flip(1))
    assert rel_err(y_flip, y.flip(1)) < 1e-12


@pytest.mark.parametrize("kill", ["backward", "forward"])
def test_oracle_self_mixer_direction_causality(kill):
    """Zeroing one direction's conv (weight and bias) silences it; the remaining direction must be causal
    (forward: output t sees tokens <= t) or anti-causal (backward: output t sees tokens >= t)."""
    cfg = pv.VimConfig(embed_dim=32, depth=1)
    sd = _mixer_sd(cfg, 6)
    p = "layers.0.mixer."
    sfx = "_b" if kill == "backward" else ""
    sd[p + f"conv1d{sfx}.weight"] = torch.zeros_like(sd[p + f"conv1d{sfx}.weight"])
    sd[p + f"conv1d{sfx}.bias"] = torch.zeros_like(sd[p + f"conv1d{sfx}.bias"])
    L, t0 = 12, 5
    x = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(7), dtype=F64)
    x2 = x.clone()
    x2[:, t0] += 1.0
    diff = (pv.bimamba_v2_mixer(sd, p, x2) - pv.bimamba_v2_mixer(sd, p, x)).abs().amax(dim=(0, 2))
    unaffected = slice(0, t0) if kill == "backward" else slice(t0 + 1, L)
    affected = slice(t0, L) if kill == "backward" else slice(0, t0 + 1)
    assert diff[unaffected].max() == 0
    assert diff[affected].min() > 1e-8


def test_oracle_self_param_counts_match_paper():
    for name, (d, _, _) in pv.PUBLISHED_VARIANTS.items():
        n = pv.param_count(pv.published_config(name))
        assert round(n / 1e6) == pv.PUBLISHED_PARAMS_M[d], (name, n)
    assert pv.param_count(pv.published_config("vim_tiny")) == 7_148_008
    assert pv.param_count(pv.published_config("vim_small")) == 25_796_584
    assert pv.param_count(pv.published_config("vim_base")) == 97_598_440


def test_oracle_self_random_weights_are_nontrivial():
    cfg = pv.VimConfig(embed_dim=32, depth=2, img_size=32)
    sd = pv.random_state_dict(cfg, 0)
    assert set(sd) == set(pv.published_shapes(cfg))
    for k, v in sd.items():
        assert tuple(v.shape) == pv.published_shapes(cfg)[k]
        assert v.std() > 0.01, k
        assert not torch.allclose(v, torch.ones_like(v)) and not torch.allclose(v, torch.zeros_like(v)), k
    N = cfg.d_state
    s4d = torch.log(torch.arange(1, N + 1, dtype=F64)).expand(cfg.d_inner, N)
    assert not torch.allclose(sd["layers.0.mixer.A_log"], s4d)


# ================================================================================================================
# 1. State-dict layout of every published variant (no forward)
# ================================================================================================================

@pytest.mark.parametrize("name", list(pv.PUBLISHED_VARIANTS))
def test_published_variant_state_dict_layout(timm_vim, name):
    cfg = pv.published_config(name)
    m = timm_vim.create_model(name)
    sd = m.state_dict()
    expected = pv.published_shapes(cfg)
    assert set(sd) - set(expected) == set(), "keys vim_ds has that the published model does not"
    assert set(expected) - set(sd) == set(), "published keys vim_ds lacks"
    bad = {k: (tuple(sd[k].shape), v) for k, v in expected.items() if tuple(sd[k].shape) != v}
    assert not bad, bad
    n_params = sum(p.numel() for p in m.parameters())
    assert n_params == pv.param_count(cfg)
    assert round(n_params / 1e6) == pv.PUBLISHED_PARAMS_M[cfg.embed_dim]
    assert {k for k, _ in m.named_parameters()} == set(expected), "state_dict holds buffers or non-params"
    out = m.get_classifier() if hasattr(m, "get_classifier") else m.head
    assert out.out_features == 1000


@pytest.mark.parametrize("alias", list(pv.ALIASES))
def test_alias_layout(timm_vim, alias):
    """Short aliases build the same architecture as the published name (checked at depth 2, img 64, 10 classes)."""
    cfg = pv.published_config(alias, depth=2, img_size=64, num_classes=10)
    sd = create(timm_vim, alias, cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == pv.published_shapes(cfg)
    sd_long = create(timm_vim, pv.ALIASES[alias], cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in sd_long.items()} == pv.published_shapes(cfg)


# ================================================================================================================
# 2. Logits vs the oracle, random weights, every variant family (reduced depth / image size)
# ================================================================================================================

# (published name, depth, img_size): sequence lengths 16+1, 25+1, 9+1, 9+1, 9+1; odd and even patch counts.
FAMILIES = {
    "tiny": ("vim_tiny", 3, 64),
    "tiny_s8": ("vim_tiny_s8", 2, 48),
    "small": ("vim_small", 2, 48),
    "small_s8": ("vim_small_s8", 2, 32),
    "base": ("vim_base", 2, 48),
}
BACKENDS = [None, "ref", "cpu"]  # None: whatever vim_ds picks by default

# float64 agreement is ~1e-15 in practice. The brief's bound was 1e-5, but at 1e-5 an RMSNorm eps of 1e-6 instead
# of 1e-5 passes (it moves these logits by 8.5e-6), so float64 is held to 1e-10. float32: 1e-4 (seen: <1e-6).
F64_TOL = 1e-10
F32_TOL = 1e-4


def _family_case(family, seed):
    alias, depth, img = FAMILIES[family]
    cfg = pv.published_config(alias, depth=depth, img_size=img, num_classes=10)
    return pv.ALIASES[alias], cfg, pv.random_state_dict(cfg, seed)


def _set_backend(monkeypatch, backend):
    if backend is None:
        monkeypatch.delenv("VIM_DS_SCAN", raising=False)
    else:
        monkeypatch.setenv("VIM_DS_SCAN", backend)


def _cases():
    for fam in FAMILIES:
        for dtype in (F64, F32):
            for backend in (BACKENDS if fam == "tiny" else [None]):
                yield pytest.param(fam, dtype, backend, id=f"{fam}-{str(dtype)[6:]}-{backend or 'default'}")


@pytest.mark.parametrize("family,dtype,backend", list(_cases()))
def test_logits_match_published_oracle(timm_vim, monkeypatch, family, dtype, backend):
    _set_backend(monkeypatch, backend)
    name, cfg, sd = _family_case(family, seed=10 + list(FAMILIES).index(family))
    x = images(cfg, batch=2, seed=20)
    model = load_published(create(timm_vim, name, cfg), sd, dtype)
    with torch.no_grad():
        got = model(x.to(dtype))
        exact = pv.vim_forward(sd, x, cfg)                                        # float64 oracle
        want = exact if dtype == F64 else pv.vim_forward(sd, x.to(F32), cfg)      # same-precision oracle
    assert got.shape == (2, cfg.num_classes) and got.dtype == dtype
    assert torch.isfinite(got).all()
    assert exact.std() > 0.1  # the comparison is not between near-zero logits
    if dtype == F64:
        assert rel_err(got, want) <= F64_TOL, f"float64 rel err {rel_err(got, want):.3e}"
    else:
        assert rel_err(got, want) <= F32_TOL, f"float32 rel err vs fp32 oracle {rel_err(got, want):.3e}"
        assert rel_err(got, exact) <= F32_TOL, f"float32 rel err vs fp64 oracle {rel_err(got, exact):.3e}"


def test_logits_depend_on_every_block_and_position(timm_vim):
    """Guards the test itself: perturbing the last block's backward-direction weights or one corner pixel changes
    both oracle and vim_ds logits identically (so both directions and all blocks are exercised)."""
    name, cfg, sd = _family_case("tiny", seed=30)
    x = images(cfg, batch=1, seed=31)
    model = load_published(create(timm_vim, name, cfg), sd, F64)
    sd2 = dict(sd)
    k = f"layers.{cfg.depth - 1}.mixer.dt_proj_b.bias"
    sd2[k] = sd[k] + 0.5
    x2 = x.clone()
    x2[..., -1, -1] += 1.0  # last patch: reaches the middle cls token only through the backward scan
    with torch.no_grad():
        base = pv.vim_forward(sd, x, cfg)
        for sd_i, x_i in ((sd2, x), (sd, x2)):
            want = pv.vim_forward(sd_i, x_i, cfg)
            assert rel_err(want, base) > 1e-6
            got = load_published(create(timm_vim, name, cfg), sd_i, F64)(x_i)
            assert rel_err(got, want) <= F64_TOL
        assert rel_err(model(x), base) <= F64_TOL


# ================================================================================================================
# 3. Published checkpoint format round trips
# ================================================================================================================

def test_published_checkpoint_into_vim_ds(timm_vim, tmp_path):
    """A {"model": sd} checkpoint as the published trainer writes it loads strictly into vim_ds."""
    name, cfg, sd = _family_case("small_s8", seed=40)
    sd32 = {k: v.to(F32) for k, v in sd.items()}  # published checkpoints are fp32
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": sd32}, path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = create(timm_vim, name, cfg)
    model.load_state_dict(ckpt["model"], strict=True)
    model = model.double().eval()
    x = images(cfg, batch=2, seed=41)
    with torch.no_grad():
        assert rel_err(model(x), pv.vim_forward(ckpt["model"], x, cfg)) <= F64_TOL


def test_vim_ds_state_dict_runs_in_oracle(timm_vim, tmp_path):
    """The reverse: vim_ds's own (initialised) weights, saved as {"model": state_dict}, give the same logits in
    the oracle. Perturbed away from init so that D=1, A=S4D etc. do not hide mistakes."""
    name, cfg, _ = _family_case("tiny_s8", seed=0)
    model = create(timm_vim, name, cfg).double().eval()
    g = torch.Generator().manual_seed(50)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=F64))
    path = tmp_path / "vim_ds.pth"
    torch.save({"model": model.state_dict()}, path)
    sd = torch.load(path, map_location="cpu", weights_only=True)["model"]
    assert set(sd) == set(pv.published_shapes(cfg))
    x = images(cfg, batch=2, seed=51)
    with torch.no_grad():
        assert rel_err(model(x), pv.vim_forward(sd, x, cfg)) <= F64_TOL


# ================================================================================================================
# 4. One mixer from the paper's equations
# ================================================================================================================

@pytest.mark.parametrize("width", [192, 384])
def test_single_mixer_matches_equations(timm_vim, width):
    alias = {192: "vim_tiny", 384: "vim_small"}[width]
    cfg = pv.published_config(alias, depth=1, img_size=32, num_classes=10)
    sd = pv.random_state_dict(cfg, seed=60 + width)
    model = load_published(create(timm_vim, pv.ALIASES[alias], cfg), sd, F64)
    x = torch.randn(2, 17, width, generator=torch.Generator().manual_seed(61), dtype=F64)
    with torch.no_grad():
        got = model.layers[0].mixer(x)
    want = pv.bimamba_v2_mixer(sd, "layers.0.mixer.", x, cfg.d_state)
    assert got.shape == want.shape == (2, 17, width)
    assert rel_err(got, want) <= F64_TOL, f"mixer rel err {rel_err(got, want):.3e}"


# ================================================================================================================
# 5. The norm through torch's fused op
# ================================================================================================================

def _rms_norm_spelled_out(x, weight, eps, eps_inside=True):
    """The formula as the model spelled it before it called F.rms_norm (in >= fp32, out in the weight's dtype);
    eps_inside=False adds eps after the root instead: the negative control."""
    x = x.to(pv._acc(x.dtype))
    ms = x.pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(ms + eps) if eps_inside else x / (torch.sqrt(ms) + eps)
    return (y * weight.to(pv._acc(weight.dtype))).to(weight.dtype)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype, weight_dtype", [(F32, F32), (F32, torch.bfloat16), (F64, F64)])
def test_rms_norm_gives_the_bits_of_the_formula_on_cpu(dtype, weight_dtype, fused, monkeypatch):
    """On CPU F.rms_norm runs the same operations as the formula it replaced (its fused kernel is the GPUs'), so
    the model's numbers there do not move: output, dx and dweight bitwise equal, with a bf16 weight too (as under
    DeepSpeed's bf16, the residual stream in fp32); so does the formula the model keeps for torch without the
    fused op (fused=False). Negative control: eps added after the root differs."""
    from vim_ds.models import RMSNorm
    from vim_ds.ops import rms_norm

    if fused and not rms_norm.TORCH_FUSES_RMS_NORM:
        pytest.skip("this torch has no fused RMSNorm op")
    monkeypatch.setattr(rms_norm, "TORCH_FUSES_RMS_NORM", fused)

    g = torch.Generator().manual_seed(70)
    norm = RMSNorm(384).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(384, generator=g, dtype=F64) + 1)
    x = torch.randn(3, 41, 384, generator=g, dtype=F64).to(dtype) * 3
    dy = torch.randn(3, 41, 384, generator=g, dtype=F64).to(weight_dtype)

    def run(fn, weight):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        return y.detach(), xi.grad, weight.grad

    got = run(norm, norm.weight)
    w = norm.weight.detach().clone().requires_grad_()
    want = run(lambda xi: _rms_norm_spelled_out(xi, w, norm.eps), w)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    w = norm.weight.detach().clone().requires_grad_()
    control = run(lambda xi: _rms_norm_spelled_out(xi, w, norm.eps, eps_inside=False), w)
    assert not torch.equal(got[0], control[0]) and not torch.equal(got[1], control[1])
