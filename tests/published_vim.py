"""Independent, deliberately naive re-implementation of the *published* Vision Mamba (Vim) forward pass.

This module is a test oracle. It re-derives the inference forward pass of the published code
(github.com/hustvl/Vim: ``vim/models_mamba.py`` ``VisionMamba`` with ``rms_norm=True, fused_add_norm=True,
residual_in_fp32=True, bimamba_type="v2", if_divide_out=True, use_middle_cls_token=True``, and
``mamba-1p1p1/mamba_ssm/modules/mamba_simple.py`` ``Mamba`` on its fast path ``mamba_inner_fn_no_out_proj``)
from the equations, as plain functions over a published-format ``state_dict``. It imports nothing from
``vim_ds`` and is written for obviousness, not speed: an explicit per-time-step loop for the scan, the causal
depthwise conv as ``F.pad`` plus a sum over the four taps, RMSNorm spelled out.

Forward pass (eval mode; dropout and drop-path are identities):

    tokens   = Conv2d(3, D, kernel=patch, stride=stride)(img).flatten(2).transpose(1, 2)    (B, M, D)
    x        = cat(tokens[:, :M//2], cls_token, tokens[:, M//2:]) + pos_embed              (B, M+1, D)
    residual = None; hidden = x
    for each block:  residual = hidden if residual is None else residual + hidden   (kept in >= fp32)
                     hidden   = mixer(RMSNorm(residual; norm.weight, eps=1e-5))
    feats    = RMSNorm(residual + hidden; norm_f.weight)[:, M//2]
    logits   = head(feats)

    mixer(h):  xz = in_proj(h) -> x, z   (each (B, d_inner, L))
               out_f = direction(x, z, conv1d, x_proj, dt_proj, A_log, D)
               out_b = direction(flip(x), flip(z), conv1d_b, x_proj_b, dt_proj_b, A_b_log, D_b)
               return out_proj((out_f + flip(out_b)) / 2)
    direction: u = silu(causal_depthwise_conv(x) + conv_bias)
               dt, Bm, Cm = split(x_proj(u), [dt_rank, N, N])
               delta = softplus(dt_proj.weight @ dt + dt_proj.bias)
               h_t = exp(delta_t * A) * h_{t-1} + delta_t * Bm_t * u_t,   A = -exp(A_log),  h_{-1} = 0
               y_t = <h_t, Cm_t> + D * u_t;  return y * silu(z)

Train mode (``vim_forward(..., train=...)``): dropout after the position embedding and stochastic depth on each
mixer output as it joins the residual stream, drawn in the published order. Construction (the end of this file):
what the published ``VisionMamba.__init__`` builds for a run's arguments (modules, stochastic-depth schedule,
flags, initialisation rules), from main.py's and the run scripts' options, as data.

Precision: everything is computed in the dtype of the images, except RMSNorm, the residual stream and the scan,
which are computed in ``promote(dtype, float32)`` (the published code keeps these in fp32; for float64 inputs
this oracle stays in float64, making the float64 comparison a check of the mathematics).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# Published variants
# ----------------------------------------------------------------------------------------------------------------

_SUFFIX = "224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"

# name -> (embed_dim, patch_size, stride); all depth 24, img 224, d_state 16, 1000 classes.
PUBLISHED_VARIANTS: Dict[str, Tuple[int, int, int]] = {
    f"vim_tiny_patch16_{_SUFFIX}": (192, 16, 16),
    f"vim_tiny_patch16_stride8_{_SUFFIX}": (192, 16, 8),
    f"vim_small_patch16_{_SUFFIX}": (384, 16, 16),
    f"vim_small_patch16_stride8_{_SUFFIX}": (384, 16, 8),
    "vim_base_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_middle_cls_token_div2": (768, 16, 16),
}

ALIASES: Dict[str, str] = {
    "vim_tiny": f"vim_tiny_patch16_{_SUFFIX}",
    "vim_small": f"vim_small_patch16_{_SUFFIX}",
    "vim_base": "vim_base_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_middle_cls_token_div2",
    "vim_tiny_s8": f"vim_tiny_patch16_stride8_{_SUFFIX}",
    "vim_small_s8": f"vim_small_patch16_stride8_{_SUFFIX}",
}

# Parameter counts as published (Zhu et al. 2024, Table 1: Vim-Ti 7M, Vim-S 26M, Vim-B 98M), in millions.
PUBLISHED_PARAMS_M: Dict[int, int] = {192: 7, 384: 26, 768: 98}


@dataclass(frozen=True)
class VimConfig:
    embed_dim: int
    depth: int = 24
    patch_size: int = 16
    stride: int = 16
    img_size: int = 224
    num_classes: int = 1000
    in_chans: int = 3
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    eps: float = 1e-5

    @property
    def d_inner(self) -> int:
        return self.expand * self.embed_dim

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.embed_dim / 16)

    @property
    def grid(self) -> int:
        return (self.img_size - self.patch_size) // self.stride + 1

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def seq_len(self) -> int:
        return self.num_patches + 1

    @property
    def cls_position(self) -> int:
        return self.num_patches // 2


def published_config(name: str, **overrides) -> VimConfig:
    name = ALIASES.get(name, name)
    d, p, s = PUBLISHED_VARIANTS[name]
    kw = dict(embed_dim=d, patch_size=p, stride=s)
    kw.update(overrides)
    return VimConfig(**kw)


# ----------------------------------------------------------------------------------------------------------------
# State-dict layout
# ----------------------------------------------------------------------------------------------------------------

def published_shapes(cfg: VimConfig) -> Dict[str, Tuple[int, ...]]:
    """Every key of the published VisionMamba state_dict with its shape (no buffers exist)."""
    D, E, N, R, K = cfg.embed_dim, cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.d_conv
    shapes: Dict[str, Tuple[int, ...]] = {
        "cls_token": (1, 1, D),
        "pos_embed": (1, cfg.num_patches + 1, D),
        "patch_embed.proj.weight": (D, cfg.in_chans, cfg.patch_size, cfg.patch_size),
        "patch_embed.proj.bias": (D,),
        "head.weight": (cfg.num_classes, D),
        "head.bias": (cfg.num_classes,),
        "norm_f.weight": (D,),
    }
    for i in range(cfg.depth):
        p = f"layers.{i}."
        shapes[p + "norm.weight"] = (D,)
        m = p + "mixer."
        shapes[m + "A_log"] = (E, N)
        shapes[m + "D"] = (E,)
        shapes[m + "A_b_log"] = (E, N)
        shapes[m + "D_b"] = (E,)
        shapes[m + "in_proj.weight"] = (2 * E, D)
        shapes[m + "out_proj.weight"] = (D, E)
        for sfx in ("", "_b"):
            shapes[m + f"conv1d{sfx}.weight"] = (E, 1, K)
            shapes[m + f"conv1d{sfx}.bias"] = (E,)
            shapes[m + f"x_proj{sfx}.weight"] = (R + 2 * N, E)
            shapes[m + f"dt_proj{sfx}.weight"] = (E, R)
            shapes[m + f"dt_proj{sfx}.bias"] = (E,)
    return shapes


def param_count(cfg: VimConfig) -> int:
    return sum(math.prod(s) for s in published_shapes(cfg).values())


def random_state_dict(cfg: VimConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> Dict[str, torch.Tensor]:
    """A published-format state dict with random, non-trivial values in every entry (nothing at its init value).

    Scales keep activations O(1) and the scan well conditioned: softplus(delta) roughly in (0.01, 2),
    A = -exp(A_log) with A_log in (-1, 2) varying per channel and state, norms' weights around 1 but not 1.
    """
    g = torch.Generator().manual_seed(seed)
    D, E, R = cfg.embed_dim, cfg.d_inner, cfg.dt_rank

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std + mean

    def unif(*shape, lo, hi):
        return torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo

    sd: Dict[str, torch.Tensor] = {}
    for key, shape in published_shapes(cfg).items():
        leaf = key.rsplit(".", 1)[-1] if "." in key else key
        parent = key.rsplit(".", 2)[-2] if key.count(".") >= 1 else ""
        if key == "patch_embed.proj.weight":
            v = randn(*shape, std=1.0 / math.sqrt(cfg.in_chans * cfg.patch_size ** 2))
        elif key in ("cls_token", "pos_embed"):
            v = randn(*shape, std=0.5)
        elif key.endswith("norm.weight") or key == "norm_f.weight":
            v = unif(*shape, lo=0.5, hi=1.5)
        elif leaf in ("A_log", "A_b_log"):
            v = unif(*shape, lo=-1.0, hi=2.0)
        elif leaf in ("D", "D_b"):
            v = randn(*shape, std=1.0)
        elif parent.startswith("conv1d") and leaf == "weight":
            v = randn(*shape, std=0.5)
        elif parent.startswith("conv1d") and leaf == "bias":
            v = randn(*shape, std=0.3)
        elif parent.startswith("dt_proj") and leaf == "weight":
            v = randn(*shape, std=0.5 / math.sqrt(R))
        elif parent.startswith("dt_proj") and leaf == "bias":
            v = unif(*shape, lo=-4.0, hi=1.0)
        elif parent.startswith("x_proj"):
            v = randn(*shape, std=1.0 / math.sqrt(E))
        elif key.endswith("in_proj.weight"):
            v = randn(*shape, std=1.0 / math.sqrt(D))
        elif key.endswith("out_proj.weight"):
            v = randn(*shape, std=1.0 / math.sqrt(E))
        elif key.endswith(".bias"):  # patch_embed.proj.bias, head.bias
            v = randn(*shape, std=0.2)
        elif key == "head.weight":
            v = randn(*shape, std=1.0 / math.sqrt(D))
        else:  # pragma: no cover - the table above is exhaustive
            raise KeyError(key)
        sd[key] = v.to(dtype).contiguous()
    return sd


# ----------------------------------------------------------------------------------------------------------------
# Building blocks, written from the equations
# ----------------------------------------------------------------------------------------------------------------

def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """y = x / sqrt(mean(x^2 over the last dim) + eps) * weight, computed in >= fp32; returns the accumulation dtype."""
    a = _acc(x.dtype)
    x = x.to(a)
    ms = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(ms + eps) * weight.to(a)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    # log(1 + e^x), written stably: max(x, 0) + log1p(e^{-|x|}).  (The CUDA kernel uses x for x > 20: same to
    # within e^-20 relative.)
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))


def causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x: (B, E, L); weight: (E, 1, K); out[b, e, t] = bias[e] + sum_k weight[e, 0, k] * x[b, e, t - (K-1) + k]."""
    K = weight.shape[-1]
    L = x.shape[-1]
    xp = F.pad(x, (K - 1, 0))  # zeros on the left: x[t'] = 0 for t' < 0
    out = torch.zeros_like(x)
    for k in range(K):
        out = out + weight[:, 0, k][None, :, None] * xp[:, :, k:k + L]
    if bias is not None:
        out = out + bias[None, :, None]
    return out


def selective_scan_naive(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """The Mamba-1 selective scan, one time step at a time (the semantics of ``selective_scan_ref``).

    u, delta, z: (batch, E, L); A: (E, N); B, C: (batch, N, L); D, delta_bias: (E,).
    Computed in >= fp32; returns u's dtype.
    """
    out_dtype = u.dtype
    a = _acc(u.dtype)
    u, delta, A, B, C = (t.to(a) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(a)[None, :, None]
    if delta_softplus:
        delta = softplus(delta)
    batch, E, L = u.shape
    N = A.shape[1]
    h = torch.zeros(batch, E, N, dtype=a)
    ys = []
    for t in range(L):
        dt = delta[:, :, t][:, :, None]                         # (batch, E, 1)
        decay = torch.exp(dt * A[None])                          # (batch, E, N)
        drive = dt * B[:, None, :, t] * u[:, :, t][:, :, None]   # (batch, E, N)
        h = decay * h + drive
        ys.append((h * C[:, None, :, t]).sum(-1))               # (batch, E)
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.to(a)[None, :, None] * u
    if z is not None:
        y = y * silu(z.to(a))
    return y.to(out_dtype)


def selective_scan_quadratic(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """Same operation as ``selective_scan_naive`` written in closed form (no recurrence):

        y_t = sum_{s <= t} sum_n C[n, t] * exp(A[n] * sum_{r=s+1..t} delta_r) * delta_s * B[n, s] * u_s  (+ D u_t)

    Used only to cross-check the recurrence. O(L^2); float64 recommended.
    """
    out_dtype = u.dtype
    a = _acc(u.dtype)
    u, delta, A, B, C = (t.to(a) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(a)[None, :, None]
    if delta_softplus:
        delta = softplus(delta)
    L = u.shape[-1]
    cum = torch.cumsum(delta, dim=-1)                                   # (b, E, L): sum_{r<=t} delta_r
    seg = cum[:, :, :, None] - cum[:, :, None, :]                       # (b, E, t, s) = sum_{r=s+1..t} delta_r
    causal = torch.ones(L, L, dtype=torch.bool).tril()                  # s <= t
    seg = seg.masked_fill(~causal, 0.0)
    decay = torch.exp(seg[..., None] * A[None, :, None, None, :])       # (b, E, t, s, N)
    decay = decay * causal[None, None, :, :, None]
    kern = torch.einsum("bnt,betsn,bns->bets", C, decay, B)             # (b, E, t, s)
    y = torch.einsum("bets,bes->bet", kern, delta * u)
    if D is not None:
        y = y + D.to(a)[None, :, None] * u
    if z is not None:
        y = y * silu(z.to(a))
    return y.to(out_dtype)


def mamba_direction(x, z, conv_w, conv_b, x_proj_w, dt_proj_w, dt_proj_b, A_log, D, d_state: int):
    """One direction of the v2 bidirectional mixer (``mamba_inner_fn_no_out_proj``).

    x, z: (batch, E, L). Returns y * silu(z): (batch, E, L) in x's dtype.
    """
    R = dt_proj_w.shape[1]
    u = silu(causal_depthwise_conv1d(x, conv_w, conv_b))                # (b, E, L)
    x_dbl = torch.einsum("kE,bEl->bkl", x_proj_w, u)                     # (b, R + 2N, L)
    dt, Bm, Cm = x_dbl[:, :R], x_dbl[:, R:R + d_state], x_dbl[:, R + d_state:R + 2 * d_state]
    delta = torch.einsum("Er,brl->bEl", dt_proj_w, dt)                   # no bias here: it is delta_bias
    A = -torch.exp(A_log.to(_acc(x.dtype)))
    return selective_scan_naive(u, delta, A, Bm, Cm, D=D, z=z, delta_bias=dt_proj_b, delta_softplus=True)


def bimamba_v2_mixer(sd: Dict[str, torch.Tensor], prefix: str, hidden: torch.Tensor, d_state: int = 16) -> torch.Tensor:
    """Published ``Mamba.forward`` with bimamba_type="v2", if_divide_out=True. hidden: (B, L, D) -> (B, L, D)."""
    w = {k[len(prefix):]: v.to(hidden.dtype) for k, v in sd.items() if k.startswith(prefix)}
    xz = torch.einsum("jd,bld->bjl", w["in_proj.weight"], hidden)       # (b, 2E, L)
    E = xz.shape[1] // 2
    x, z = xz[:, :E], xz[:, E:]
    out_f = mamba_direction(x, z, w["conv1d.weight"], w["conv1d.bias"], w["x_proj.weight"],
                            w["dt_proj.weight"], w["dt_proj.bias"], w["A_log"], w["D"], d_state)
    out_b = mamba_direction(x.flip(-1), z.flip(-1), w["conv1d_b.weight"], w["conv1d_b.bias"], w["x_proj_b.weight"],
                            w["dt_proj_b.weight"], w["dt_proj_b.bias"], w["A_b_log"], w["D_b"], d_state)
    y = (out_f + out_b.flip(-1)) / 2                                     # (b, E, L)
    return torch.einsum("dE,bEl->bld", w["out_proj.weight"], y)


def patch_embed(sd, images: torch.Tensor, stride: int) -> torch.Tensor:
    """Conv2d(kernel=patch, stride) then flatten row-major: (B, 3, H, W) -> (B, M, D)."""
    w = sd["patch_embed.proj.weight"].to(images.dtype)
    b = sd["patch_embed.proj.bias"].to(images.dtype)
    feat = F.conv2d(images, w, b, stride=stride)                         # (B, D, gh, gw)
    return feat.flatten(2).transpose(1, 2)


def drop_path(hidden: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth as timm's ``DropPath(p)`` (which the published Block and VisionMamba use) computes it: one
    Bernoulli(1 - p) draw per sample, ``hidden.new_empty((B, 1, 1)).bernoulli_(1 - p)``, scaled by 1 / (1 - p)."""
    if not training or p == 0.0:
        return hidden
    keep = 1.0 - p
    mask = hidden.new_empty((hidden.shape[0],) + (1,) * (hidden.ndim - 1)).bernoulli_(keep)
    if keep > 0.0:
        mask.div_(keep)
    return hidden * mask


def add_rms_norm(residual: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, eps: float,
                 dt: torch.dtype, residual_in_fp32: bool = True, fused_add_norm: bool = True):
    """The published Block's add-then-RMSNorm: (the residual stream after adding `hidden`, the norm of it in dt).

    fused_add_norm (mamba_ssm's rms_norm_fn with prenorm=True): the sum is formed and normalised in fp32 (or
    wider); the stream is kept in fp32 with residual_in_fp32, else stored in dt. Unfused: the sum is formed in the
    operands' promoted dtype, the norm reads it rounded to dt (``norm(residual.to(norm.weight.dtype))``), and the
    stream is then cast to fp32 with residual_in_fp32. The first block has no residual: the stream is `hidden`."""
    acc = _acc(dt)
    if fused_add_norm:
        s = hidden.to(acc) if residual is None else residual.to(acc) + hidden.to(acc)
        return (s if residual_in_fp32 else s.to(dt)), rms_norm(s, weight, eps).to(dt)
    s = hidden if residual is None else residual + hidden
    return (s.to(acc) if residual_in_fp32 else s), rms_norm(s.to(dt), weight, eps).to(dt)


def vim_forward(sd: Dict[str, torch.Tensor], images: torch.Tensor, cfg: VimConfig,
                return_features: bool = False, *, train: Optional[dict] = None,
                residual_in_fp32: bool = True, fused_add_norm: bool = True) -> torch.Tensor:
    """Published VisionMamba.forward. images: (B, 3, H, W) -> logits (B, num_classes).

    Eval mode unless ``train`` is given: then ``train = dict(pos_drop=p, block_drop_path=[p_0, ..., p_{depth-1}],
    final_drop_path=q)`` (what ``published_modules`` says the constructor built) applies, in the published order
    of random draws, ``F.dropout(x, p)`` after the position embedding (``pos_drop``), block i's drop path to the
    previous mixer's output as block i adds it to the residual stream (i >= 1; block 0 has no residual to add to),
    and the final drop path to the last mixer's output before ``norm_f``.

    ``residual_in_fp32`` and ``fused_add_norm`` are the published Block's flags (all published variants: True,
    True); the other values model what the published code does with them, for low-precision negative controls:
    without ``residual_in_fp32`` the stream is stored in the images' dtype; without ``fused_add_norm`` each norm
    reads the stream rounded to the images' dtype (``norm(residual.to(norm.weight.dtype))``) instead of the
    fp32 sum.
    """
    dt = images.dtype
    training = train is not None
    train = train or {}
    block_p = list(train.get("block_drop_path", [0.0] * cfg.depth))
    assert len(block_p) == cfg.depth, (len(block_p), cfg.depth)
    tokens = patch_embed(sd, images, cfg.stride)
    Bsz, M, Dm = tokens.shape
    assert M == cfg.num_patches, (M, cfg.num_patches)
    pos = M // 2
    cls = sd["cls_token"].to(dt).expand(Bsz, 1, Dm)
    x = torch.cat([tokens[:, :pos], cls, tokens[:, pos:]], dim=1) + sd["pos_embed"].to(dt)
    if training:
        x = F.dropout(x, train.get("pos_drop", 0.0), training=True)  # what nn.Dropout(p) does in train mode

    def add_norm(residual, hidden, weight):
        return add_rms_norm(residual, hidden, weight, cfg.eps, dt, residual_in_fp32, fused_add_norm)

    residual: Optional[torch.Tensor] = None
    hidden = x
    for i in range(cfg.depth):
        if residual is not None:
            hidden = drop_path(hidden, block_p[i], training)
        residual, normed = add_norm(residual, hidden, sd[f"layers.{i}.norm.weight"])
        hidden = bimamba_v2_mixer(sd, f"layers.{i}.mixer.", normed, cfg.d_state)
    hidden = drop_path(hidden, train.get("final_drop_path", 0.0), training)
    _, feats = add_norm(residual, hidden, sd["norm_f.weight"])
    feats = feats[:, pos]
    if return_features:
        return feats
    return feats @ sd["head.weight"].to(dt).t() + sd["head.bias"].to(dt)


# ----------------------------------------------------------------------------------------------------------------
# Construction: what the published constructor builds from its arguments
# ----------------------------------------------------------------------------------------------------------------
# Facts read from hustvl/Vim: vim/models_mamba.py (VisionMamba.__init__'s defaults, create_block, Block, the
# @register_model functions), mamba-1p1p1/mamba_ssm/modules/mamba_simple.py (Mamba.__init__'s defaults and init),
# vim/main.py (get_args_parser's defaults and its create_model call) and vim/scripts/*.sh (the options each run
# passes), written out here as data and rules, not code taken from there.

# VisionMamba.__init__'s keyword defaults.
VISIONMAMBA_DEFAULTS: Dict[str, object] = dict(
    img_size=224, patch_size=16, stride=16, depth=24, embed_dim=192, d_state=16, channels=3, num_classes=1000,
    ssm_cfg=None, drop_rate=0.0, drop_path_rate=0.1, norm_epsilon=1e-5, rms_norm=True, initializer_cfg=None,
    fused_add_norm=True, residual_in_fp32=True, if_bidirectional=False, final_pool_type="none",
    if_abs_pos_embed=True, if_rope=False, if_rope_residual=False, flip_img_sequences_ratio=-1.0, if_bimamba=False,
    bimamba_type="v2", if_cls_token=True, if_divide_out=True, init_layer_scale=None, use_double_cls_token=False,
    use_middle_cls_token=True)

# What every @register_model function passes to VisionMamba besides its size (then **kwargs, i.e. create_model's).
# (vim_base's function spells one of them if_devide_out=True: VisionMamba's **kwargs swallows it, and
# if_divide_out keeps its default, True: the same.)
_REGISTERED_FLAGS = dict(rms_norm=True, residual_in_fp32=True, fused_add_norm=True, final_pool_type="mean",
                         if_abs_pos_embed=True, if_rope=False, if_rope_residual=False, bimamba_type="v2",
                         if_cls_token=True, if_divide_out=True, use_middle_cls_token=True)


def registered_arguments(name: str) -> Dict[str, object]:
    """The arguments the published @register_model function `name` passes to VisionMamba (before **kwargs)."""
    name = ALIASES.get(name, name)
    d, p, s = PUBLISHED_VARIANTS[name]
    return dict(patch_size=p, stride=s, embed_dim=d, depth=24, d_state=16, **_REGISTERED_FLAGS)


# Mamba.__init__'s defaults that create_block does not override (it passes d_state, layer_idx, bimamba_type, the
# divide-out flag, init_layer_scale and **ssm_cfg).
MAMBA_DEFAULTS: Dict[str, object] = dict(d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                                         dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True,
                                         bias=False)

# vim/main.py's defaults of the options that reach the model; its call is
#   create_model(args.model, pretrained=False, num_classes=args.nb_classes, drop_rate=args.drop,
#                drop_path_rate=args.drop_path, drop_block_rate=None, img_size=args.input_size)
MAIN_PY_DEFAULTS: Dict[str, object] = dict(drop=0.0, drop_path=0.1, input_size=224)

# The options of each published run script that reach the model (each also passes --no_amp: fp32).
# The scripts name the tiny/small models "..._with_middle_cls_token_div2"; the registered functions of those
# sizes are "..._with_midclstok_div2" (the same architecture: only vim_base is registered under the long name).
PUBLISHED_SCRIPTS: Dict[str, Dict[str, object]] = {
    "hustvl/Vim vim/scripts/pt-vim-t.sh": dict(model=f"vim_tiny_patch16_{_SUFFIX}", drop_path=0.0),
    "hustvl/Vim vim/scripts/pt-vim-s.sh": dict(model=f"vim_small_patch16_{_SUFFIX}", drop_path=0.05),
    "hustvl/Vim vim/scripts/ft-vim-t.sh": dict(model=f"vim_tiny_patch16_stride8_{_SUFFIX}", drop_path=0.0),
    "hustvl/Vim vim/scripts/ft-vim-s.sh": dict(model=f"vim_small_patch16_stride8_{_SUFFIX}", drop_path=0.0),
}


# vim_ds's own recipes (tests/test_recipes.py's DERIVED): a published script with the options they change that
# reach the model. Nobody publishes a high-resolution Vim finetuning; this one is ft-vim-t.sh at 1024 x 1024 with the
# stride-16 model.
DERIVED_SCRIPTS: Dict[str, Tuple[str, Dict[str, object]]] = {
    "vim_ds, from hustvl/Vim vim/scripts/ft-vim-t.sh at 1024 x 1024": (
        "hustvl/Vim vim/scripts/ft-vim-t.sh", dict(model=f"vim_tiny_patch16_{_SUFFIX}", input_size=1024)),
}


def script_options(source: str, **overrides) -> Dict[str, object]:
    """main.py's options for the run script `source` (a recipe's ``recipe: source:``), with `overrides` as if
    typed after the script's own (argparse: the last wins)."""
    base, changes = DERIVED_SCRIPTS.get(source, (source, {}))
    return {**MAIN_PY_DEFAULTS, **PUBLISHED_SCRIPTS[base], **changes, **overrides}


def main_py_create_kwargs(options: Dict[str, object], nb_classes: int) -> Dict[str, object]:
    """The keyword arguments main.py passes to create_model for these options."""
    return dict(pretrained=False, num_classes=nb_classes, drop_rate=options["drop"],
                drop_path_rate=options["drop_path"], drop_block_rate=None, img_size=options["input_size"])


def visionmamba_arguments(name: str, create_kwargs: Dict[str, object], **size) -> Dict[str, object]:
    """Every argument VisionMamba.__init__ runs with for create_model(name, **create_kwargs): its defaults, then the
    registered function's, then create_model's (``pretrained`` is the registered function's own; anything
    VisionMamba does not name, such as drop_block_rate, lands in its ignored **kwargs).

    `size` (depth=, embed_dim=) builds the reduced-size model a test can afford: the registered functions fix
    depth and embed_dim (passing them through create_model is a TypeError there), so the published equivalent is
    VisionMamba called with the registered function's arguments and these replaced."""
    args = dict(VISIONMAMBA_DEFAULTS)
    args.update(registered_arguments(name))
    args.update(size)
    args.update({k: v for k, v in create_kwargs.items() if k in VISIONMAMBA_DEFAULTS})
    return args


def published_config_for(args: Dict[str, object]) -> VimConfig:
    ssm = {**MAMBA_DEFAULTS, **(args["ssm_cfg"] or {})}
    return VimConfig(embed_dim=args["embed_dim"], depth=args["depth"], patch_size=args["patch_size"],
                     stride=args["stride"], img_size=args["img_size"], num_classes=args["num_classes"],
                     in_chans=args["channels"], d_state=args["d_state"], d_conv=ssm["d_conv"],
                     expand=ssm["expand"], eps=args["norm_epsilon"])


def stochastic_depth(args: Dict[str, object]) -> Tuple[list, float]:
    """(each block's DropPath probability, the final one): ``dpr = linspace(0, drop_path_rate, depth)``, block i
    gets ``([0.0] + dpr)[i]`` (so block i applies dpr[i - 1] to block i-1's output as it joins the stream), and
    the final ``self.drop_path`` (on the last mixer's output, before norm_f) gets drop_path_rate itself."""
    dpr = [x.item() for x in torch.linspace(0, args["drop_path_rate"], args["depth"])]
    inter = [0.0] + dpr
    return [inter[i] for i in range(args["depth"])], float(args["drop_path_rate"])


def published_modules(args: Dict[str, object]) -> Dict[str, tuple]:
    """Every module VisionMamba(**args) builds that holds parameters or draws random numbers, by its path, as
    (kind, attributes...): ("Linear", in, out, bias), ("Conv2d"/"Conv1d", in, out, kernel, stride, padding, groups,
    bias), ("RMSNorm"/"LayerNorm", dim, eps), ("Dropout", p), ("DropPath", p) — a zero probability builds
    nn.Identity, written ("Identity",). Parameterless deterministic modules (PatchEmbed.norm = Identity, Mamba.act
    = SiLU, which the fused v2 path does not call) are left out."""
    cfg = published_config_for(args)
    D, E, N, R, K = cfg.embed_dim, cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.d_conv
    ssm = {**MAMBA_DEFAULTS, **(args["ssm_cfg"] or {})}
    norm = "RMSNorm" if args["rms_norm"] else "LayerNorm"
    eps = float(args["norm_epsilon"])
    block_p, final_p = stochastic_depth(args)

    def dp(p):
        return ("DropPath", p) if p > 0.0 else ("Identity",)

    mods: Dict[str, tuple] = {
        "patch_embed.proj": ("Conv2d", cfg.in_chans, D, (cfg.patch_size,) * 2, (cfg.stride,) * 2, (0, 0), 1, True),
        "pos_drop": ("Dropout", float(args["drop_rate"])),
        "head": ("Linear", D, cfg.num_classes, True),
        "drop_path": dp(final_p),
        "norm_f": (norm, D, eps),
    }
    assert args["bimamba_type"] == "v2" and not args["if_bimamba"], "only the v2 mixer is described here"
    for i in range(cfg.depth):
        p = f"layers.{i}."
        mods[p + "norm"] = (norm, D, eps)
        mods[p + "drop_path"] = dp(block_p[i])
        m = p + "mixer."
        mods[m + "in_proj"] = ("Linear", D, 2 * E, bool(ssm["bias"]))
        mods[m + "out_proj"] = ("Linear", E, D, bool(ssm["bias"]))
        for sfx in ("", "_b"):
            mods[m + f"conv1d{sfx}"] = ("Conv1d", E, E, (K,), (1,), (K - 1,), E, bool(ssm["conv_bias"]))
            mods[m + f"x_proj{sfx}"] = ("Linear", E, R + 2 * N, False)
            mods[m + f"dt_proj{sfx}"] = ("Linear", R, E, True)
    return mods


def published_flags(args: Dict[str, object]) -> Dict[str, object]:
    """The forward-pass choices VisionMamba(**args) makes that no module or parameter shows."""
    keys = ("residual_in_fp32", "fused_add_norm", "if_rope", "if_rope_residual", "if_bidirectional",
            "flip_img_sequences_ratio", "if_cls_token", "use_middle_cls_token", "use_double_cls_token",
            "if_abs_pos_embed", "if_divide_out", "bimamba_type", "init_layer_scale")
    flags = {k: args[k] for k in keys}
    flags["flip_img_sequences"] = args["flip_img_sequences_ratio"] > 0
    del flags["flip_img_sequences_ratio"]
    # final_pool_type is read only when there is no class token: with one, the class token is the feature.
    flags["pooled_feature"] = ("middle_cls_token" if args["if_cls_token"] and args["use_middle_cls_token"]
                               else args["final_pool_type"])
    return flags


def published_init(args: Dict[str, object]) -> Dict[str, tuple]:
    """How VisionMamba(**args) initialises each parameter (published names), as a rule a test can check:
    ("const", v); ("s4d_log",) = log(1..N) per channel; ("uniform", bound) = U(-bound, bound);
    ("trunc_normal", std) = timm's trunc_normal_(std) (cut at +-2 absolute); ("lecun_normal", fan_in);
    ("dt_bias", dt_min, dt_max, floor) = the inverse softplus of a log-uniform dt in [dt_min, dt_max], floored.

    Order of operations in the published constructor: modules' own init (nn.Linear/Conv: kaiming_uniform(a=sqrt 5)
    = U(+-1/sqrt(fan_in)) for weights and biases); Mamba's dt init of dt_proj (weight U(+-dt_rank^-0.5 * dt_scale),
    bias from dt, marked _no_reinit), A/D; then segm_init_weights on patch_embed and head (trunc_normal(0.02) /
    lecun_normal weights, zero biases); trunc_normal(0.02) on pos_embed and cls_token; then _init_weights over
    every module: every nn.Linear bias not marked _no_reinit zeroed (dt_proj_b.bias, head.bias), and every
    ``out_proj.weight`` re-drawn kaiming_uniform(a=sqrt 5) and divided by sqrt(depth)."""
    cfg = published_config_for(args)
    D, E, R, K = cfg.embed_dim, cfg.d_inner, cfg.dt_rank, cfg.d_conv
    ssm = {**MAMBA_DEFAULTS, **(args["ssm_cfg"] or {})}
    rules: Dict[str, tuple] = {
        "patch_embed.proj.weight": ("lecun_normal", cfg.in_chans * cfg.patch_size ** 2),
        "patch_embed.proj.bias": ("const", 0.0),
        "cls_token": ("trunc_normal", 0.02),
        "pos_embed": ("trunc_normal", 0.02),
        "head.weight": ("trunc_normal", 0.02),
        "head.bias": ("const", 0.0),
        "norm_f.weight": ("const", 1.0),
    }
    for i in range(cfg.depth):
        p = f"layers.{i}."
        rules[p + "norm.weight"] = ("const", 1.0)
        m = p + "mixer."
        rules[m + "in_proj.weight"] = ("uniform", 1 / math.sqrt(D))
        rules[m + "out_proj.weight"] = ("uniform", 1 / math.sqrt(E) / math.sqrt(cfg.depth))
        rules[m + "dt_proj.weight"] = ("uniform", R ** -0.5 * ssm["dt_scale"])
        rules[m + "dt_proj.bias"] = ("dt_bias", ssm["dt_min"], ssm["dt_max"], ssm["dt_init_floor"])
        rules[m + "dt_proj_b.weight"] = ("uniform", 1 / math.sqrt(R))   # nn.Linear's own init
        rules[m + "dt_proj_b.bias"] = ("const", 0.0)                     # zeroed by _init_weights
        for sfx in ("", "_b"):
            rules[m + f"conv1d{sfx}.weight"] = ("uniform", 1 / math.sqrt(K))  # fan_in = 1 channel x K taps
            rules[m + f"conv1d{sfx}.bias"] = ("uniform", 1 / math.sqrt(K))
            rules[m + f"x_proj{sfx}.weight"] = ("uniform", 1 / math.sqrt(E))
        rules[m + "A_log"] = rules[m + "A_b_log"] = ("s4d_log",)
        rules[m + "D"] = rules[m + "D_b"] = ("const", 1.0)
    return rules
