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
    D, E, N, R = cfg.embed_dim, cfg.d_inner, cfg.d_state, cfg.dt_rank

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


def vim_forward(sd: Dict[str, torch.Tensor], images: torch.Tensor, cfg: VimConfig,
                return_features: bool = False) -> torch.Tensor:
    """Published VisionMamba.forward in eval mode. images: (B, 3, H, W) -> logits (B, num_classes)."""
    dt = images.dtype
    acc = _acc(dt)
    tokens = patch_embed(sd, images, cfg.stride)
    Bsz, M, Dm = tokens.shape
    assert M == cfg.num_patches, (M, cfg.num_patches)
    pos = M // 2
    cls = sd["cls_token"].to(dt).expand(Bsz, 1, Dm)
    x = torch.cat([tokens[:, :pos], cls, tokens[:, pos:]], dim=1) + sd["pos_embed"].to(dt)

    residual: Optional[torch.Tensor] = None
    hidden = x
    for i in range(cfg.depth):
        residual = hidden.to(acc) if residual is None else residual + hidden.to(acc)
        normed = rms_norm(residual, sd[f"layers.{i}.norm.weight"], cfg.eps).to(dt)
        hidden = bimamba_v2_mixer(sd, f"layers.{i}.mixer.", normed, cfg.d_state)
    residual = residual + hidden.to(acc)
    feats = rms_norm(residual, sd["norm_f.weight"], cfg.eps).to(dt)[:, pos]
    if return_features:
        return feats
    return feats @ sd["head.weight"].to(dt).t() + sd["head.bias"].to(dt)
