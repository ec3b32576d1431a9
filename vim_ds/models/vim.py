"""Vision Mamba (Vim, Zhu et al. 2024): bidirectional Mamba blocks over patch tokens with a middle class token.

Parameter names, shapes and initialisation follow the published implementation (hustvl/Vim, ``models_mamba.py``
with ``bimamba_type="v2"``), so its checkpoints load with ``strict=True`` and give the same logits.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from timm.layers import DropPath, lecun_normal_, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

# what timm's own models use (not re-exported)
from timm.models._features import feature_take_indices

from ..ops.rms_norm import add_rms_norm, at_least_fp32, rms_norm, scaled_by_sample
from ..ops.ssm_branch import bimamba_branch_fn, in_projection, out_projection

# torch.fx records calls to these names in this module as single graph nodes instead of tracing into them, for
# every fx tracer (timm's and torchvision's create_feature_extractor alike): the fused SSM branches and the fused add
# and norm are ops whose Python dispatch cannot run on fx proxies, the projections autograd Functions (their
# backward is their own), and the image-size check must run on real shapes when the graph runs.
torch.fx.wrap("bimamba_branch_fn")
torch.fx.wrap("add_rms_norm")
torch.fx.wrap("in_projection")
torch.fx.wrap("out_projection")

TORCHSCRIPT_ERROR = ("Vim does not support TorchScript (torch.jit.script): the selective-scan op and the mixer's "
                     "Python-level dispatch cannot be scripted; use torch.compile, torch.export or torch.fx instead")


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (or wider), returned in the weight's dtype
    (``ops.rms_norm``). A block's norm runs fused with the residual add before it (``Block``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _check_image_size(x: torch.Tensor, img_size: Tuple[int, int]) -> torch.Tensor:
    if tuple(x.shape[-2:]) != img_size:
        raise ValueError(f"input images are {tuple(x.shape[-2:])}, the model was built for {img_size} "
                         f"(create it with img_size=...)")
    return x


torch.fx.wrap("_check_image_size")


def _patch_pad(size: int, patch: int, stride: int) -> int:
    """Pixels to add after `size` so that patches starting every `stride` pixels tile it exactly."""
    return patch - size if size < patch else -(size - patch) % stride


def _fit_to_patches(x: torch.Tensor, patch_size: Tuple[int, int], stride: int, pad: bool) -> torch.Tensor:
    """Any-size input (dynamic_img_size): zero-pad the bottom/right to a whole patch grid (dynamic_img_pad), or
    refuse a size whose last pixel rows/columns the patches would silently drop."""
    pads = [_patch_pad(s, p, stride) for s, p in zip(x.shape[-2:], patch_size)]
    if not any(pads):
        return x
    if pad:
        return F.pad(x, (0, pads[1], 0, pads[0]))
    raise ValueError(f"input images are {tuple(x.shape[-2:])}: not a whole grid of {patch_size[0]}x{patch_size[1]} "
                     f"patches at stride {stride} (each side must be patch + k*stride; pad them, or create the "
                     f"model with dynamic_img_pad=True)")


torch.fx.wrap("_fit_to_patches")


class PatchEmbed(nn.Module):
    """Conv patchify; with stride < patch size the patches overlap (the stride-8 "fine granularity" variants).

    dynamic_img_size: accept any image size (the token grid follows the input); dynamic_img_pad: zero-pad the
    bottom/right of an image whose sides are not patch + k*stride (else such a size is an error)."""

    def __init__(self, img_size=224, patch_size=16, stride=16, in_chans=3, embed_dim=192, dynamic_img_size=False,
                 dynamic_img_pad=False):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        self.stride = stride
        self.dynamic_img_size = dynamic_img_size
        self.dynamic_img_pad = dynamic_img_pad
        self.grid_size = self.grid_for(self.img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=stride)

    def grid_for(self, img_size) -> Tuple[int, int]:
        """The token grid of an (H, W) image (after dynamic_img_pad's padding, when set)."""
        pads = [_patch_pad(s, p, self.stride) if self.dynamic_img_pad else 0
                for s, p in zip(img_size, self.patch_size)]
        return tuple((s + q - p) // self.stride + 1 for s, q, p in zip(img_size, pads, self.patch_size))

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> (batch, embed_dim, *grid) patch embeddings."""
        if self.dynamic_img_size:
            x = _fit_to_patches(x, self.patch_size, self.stride, self.dynamic_img_pad)
        else:
            x = _check_image_size(x, self.img_size)
            if self.dynamic_img_pad:
                x = _fit_to_patches(x, self.patch_size, self.stride, True)
        return self.proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_map(x).flatten(2).transpose(1, 2)  # (batch, num_patches, embed_dim)


class BiMambaMixer(nn.Module):
    """Bidirectional Mamba ("v2"): one in_proj; a forward and a backward SSM branch with their own conv1d, x_proj,
    dt_proj, A and D; the backward branch reads the sequence reversed; outputs averaged, then out_proj."""

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                 dt_init_floor=1e-4, conv_bias=True, bias=False, divide_out=True, n_layer=24):
        super().__init__()
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.divide_out = divide_out
        d_inner = self.d_inner

        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=bias)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=conv_bias)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(self._s4d_real_log(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.A_b_log = nn.Parameter(self._s4d_real_log(d_inner, d_state))
        self.conv1d_b = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=conv_bias)
        self.x_proj_b = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj_b = nn.Linear(self.dt_rank, d_inner, bias=True)
        self.D_b = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias)

        # As published: dt_proj (forward branch) gets Mamba's dt init; the backward branch's dt_proj_b keeps the
        # default Linear weight init and its bias is zeroed below, like every other Linear bias.
        std = self.dt_rank ** -0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        dt = torch.exp(torch.rand(d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            # inverse softplus: softplus(bias) = dt
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            for linear in (self.in_proj, self.x_proj, self.dt_proj_b, self.x_proj_b, self.out_proj):
                if linear.bias is not None:
                    linear.bias.zero_()
            # GPT-2 style: out_proj (the residual branch's last layer) scaled by 1/sqrt(depth).
            nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
            self.out_proj.weight /= math.sqrt(n_layer)
        for p in (self.A_log, self.A_b_log, self.D, self.D_b):
            p._no_weight_decay = True

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling: one clear line instead of a deep
        # TorchScript frontend traceback.
        raise RuntimeError(TORCHSCRIPT_ERROR)

    @staticmethod
    def _s4d_real_log(d_inner, d_state):
        # S4D-real: A = -(1, 2, ..., N) for every channel; stored as log(-A).
        return torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1).contiguous()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (batch, L, d_model) -> (batch, L, d_model)."""
        # W @ hidden^T gives x and z directly in the scan's (batch, channels, L) layout, without transposed copies;
        # two half-projections instead of one xz tensor, so that their gradients need no concatenation.
        w_x, w_z = self.in_proj.weight.chunk(2, dim=0)
        x, z = in_projection(hidden, w_x, w_z)  # (batch, d_inner, L) each
        if self.in_proj.bias is not None:
            b_x, b_z = self.in_proj.bias.chunk(2)
            x, z = x + b_x[:, None], z + b_z[:, None]
        # The backward direction runs on the same x and z, scanned back to front in place (no flipped copies); the
        # two directions' outputs are summed inside the op (on GPUs, in the second scan's store).
        y = bimamba_branch_fn(
            x, z, (self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                   -torch.exp(at_least_fp32(self.A_log)), self.D, self.dt_proj.bias),
            (self.conv1d_b.weight, self.conv1d_b.bias, self.x_proj_b.weight, self.dt_proj_b.weight,
             -torch.exp(at_least_fp32(self.A_b_log)), self.D_b, self.dt_proj_b.bias))
        # "Divide out" halves the sum; applied to out_proj's (d_model, d_inner) weight instead of the (batch,
        # d_inner, L) activation, it saves a full pass over y in forward and one in backward. Exact: scaling by a
        # power of two commutes with rounding, so the result is bitwise that of halving y.
        w_out = self.out_proj.weight * 0.5 if self.divide_out else self.out_proj.weight
        out = out_projection(y, w_out)  # (batch, L, d_model), rows contiguous
        return out if self.out_proj.bias is None else out + self.out_proj.bias


def _join_scale(drop_path: nn.Module, hidden: torch.Tensor):
    """(hidden, scale) for add_rms_norm from a mixer output that joins the stream through `drop_path`: timm's DropPath
    in training gives its mask over the keep probability as a per-sample scale, drawn as it draws it (its call on a
    (batch, 1, ...) tensor of ones: the same shape of draw, the mask itself), which the fused kernel applies as it
    adds; the composition multiplies as DropPath does, so on CPU the bits are DropPath's. Anything else is applied
    to hidden as it is."""
    if isinstance(drop_path, nn.Identity):
        return hidden, None
    if isinstance(drop_path, DropPath):
        if not drop_path.training or drop_path.drop_prob == 0:
            return hidden, None
        return hidden, drop_path(hidden.new_ones((hidden.shape[0],) + (1,) * (hidden.dim() - 1)))
    return drop_path(hidden), None


class Block(nn.Module):
    """Add -> RMSNorm -> mixer, returning (mixer output, residual): the published block. The residual stream is kept
    in fp32; the add and the norm are one kernel forward and one backward on GPUs (``ops.add_rms_norm``)."""

    def __init__(self, dim, mixer: nn.Module, drop_path=0.0, norm_eps=1e-5):
        super().__init__()
        self.mixer = mixer
        self.norm = RMSNorm(dim, eps=norm_eps)
        # Applied to the previous block's mixer output as it joins the residual stream (published layout).
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, hidden, residual: Optional[torch.Tensor] = None):
        """hidden: the previous block's mixer output (the embedded tokens for the first block, with residual None);
        residual: the stream before it. Returns (this block's mixer output, the stream it normalised)."""
        scale = None
        if residual is not None:
            hidden, scale = _join_scale(self.drop_path, hidden)
        normed, residual = add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps, scale=scale)
        return self.mixer(normed), residual


class VisionMamba(nn.Module):
    """Vim classifier. Keyword names follow the published ``VisionMamba`` where they exist there.

    The timm model API: ``num_features``/``head_hidden_size``, ``get_classifier``/``reset_classifier``,
    ``forward_intermediates``/``prune_intermediate_layers`` (hence ``features_only=True``), ``feature_info``,
    ``set_grad_checkpointing`` and ``group_matcher``.
    """

    def __init__(self, img_size=224, patch_size=16, stride=16, depth=24, embed_dim=192, d_state=16, channels=3,
                 in_chans=None, num_classes=1000, drop_rate=0.0, drop_path_rate=0.1, norm_epsilon=1e-5,
                 drop_block_rate=None, ssm_cfg: Optional[dict] = None, divide_out=True, global_pool="token",
                 dynamic_img_size=False, dynamic_img_pad=False):
        super().__init__()
        if drop_block_rate:
            raise ValueError("drop_block_rate is not supported by Vim (it has no convolutional stages)")
        if global_pool != "token":
            raise ValueError(f"Vim pools its middle class token; global_pool={global_pool!r} is not supported")
        in_chans = channels if in_chans is None else in_chans
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.depth = depth
        self.global_pool = global_pool
        self.grad_checkpointing = False
        # forward(model, images) that replaces the unsplit forward under sequence parallelism (split_sequence)
        self._sequence_split = None
        self.dynamic_img_size = dynamic_img_size

        self.patch_embed = PatchEmbed(img_size, patch_size, stride, in_chans, embed_dim,
                                      dynamic_img_size=dynamic_img_size, dynamic_img_pad=dynamic_img_pad)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)

        # cpu: also under meta
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth, device="cpu")]
        ssm_cfg = dict(ssm_cfg or {})
        self.layers = nn.ModuleList([
            Block(embed_dim,
                  BiMambaMixer(embed_dim, d_state=d_state, divide_out=divide_out, n_layer=depth, **ssm_cfg),
                  drop_path=dpr[i - 1] if i > 0 else 0.0, norm_eps=norm_epsilon)
            for i in range(depth)
        ])
        # last mixer's output
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()
        self.norm_f = RMSNorm(embed_dim, eps=norm_epsilon)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        # Every block's output is a (embed_dim, grid) map at the patch stride (see forward_intermediates).
        self.feature_info = [dict(module=f"layers.{i}", num_chs=embed_dim, reduction=stride) for i in range(depth)]
        self._init_weights()

    def _init_weights(self):
        lecun_normal_(self.patch_embed.proj.weight)
        nn.init.zeros_(self.patch_embed.proj.bias)
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        if isinstance(self.head, nn.Linear):
            trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # dynamic_img_size: any input size is served from one position-embedding table, so a plain
        # load_state_dict of another size's weights (timm's load_checkpoint, e.g. validate.py --checkpoint with
        # --img-size) resamples a square grid's table to ours, as checkpoint_filter_fn does. Static models keep
        # the strict shape check.
        key = prefix + "pos_embed"
        loaded = state_dict.get(key)
        if (self.dynamic_img_size and torch.is_tensor(loaded) and loaded.ndim == 3
                and loaded.shape != self.pos_embed.shape and loaded.shape[-1] == self.pos_embed.shape[-1]):
            side = math.isqrt(loaded.shape[1] - 1)
            if side * side == loaded.shape[1] - 1:
                state_dict[key] = resample_pos_embed(loaded, (side, side), self.patch_embed.grid_size)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def token_position(self) -> int:
        """Index of the class token: the middle of the patch sequence (at the built img_size; with
        dynamic_img_size, the middle of the input's own sequence: num_patches // 2 for its grid)."""
        return self.patch_embed.num_patches // 2

    def _cls_index(self, tokens: torch.Tensor):
        """Where the class token is in `tokens` (batch, num_patches + 1, C)."""
        return (tokens.shape[1] - 1) // 2 if self.dynamic_img_size else self.token_position

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for timm's layer-wise learning-rate decay: the embedding, one group per block, the
        final norm last."""
        return dict(stem=r"^cls_token|pos_embed|patch_embed",
                    blocks=[(r"^layers\.(\d+)", None), (r"^norm_f", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them (torch.utils.checkpoint,
        non-reentrant; stochastic depth replays the same masks). Gradients are unchanged."""
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None):
        if global_pool not in (None, "token"):
            raise ValueError(f"Vim pools its middle class token; global_pool={global_pool!r} is not supported")
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if isinstance(self.head, nn.Linear):
            self.head.to(self.pos_embed.device, self.pos_embed.dtype)
            trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
        self.head.train(self.training)

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Images -> (patch tokens with the class token inserted in the middle, plus position embeddings; the
        token grid). With dynamic_img_size the position embeddings are resampled to the input's grid, exactly as
        checkpoint_filter_fn resamples them for a model built at that size."""
        feature_map = self.patch_embed.forward_map(x)
        x = feature_map.flatten(2).transpose(1, 2)
        grid, pos_embed, pos = self.patch_embed.grid_size, self.pos_embed, self.token_position
        if self.dynamic_img_size:
            # shapes read on the tensor, so fx traces and torch.compile see them as the input's, not constants
            grid, pos = feature_map.shape[-2:], x.shape[1] // 2
            pos_embed = _pos_embed_for_map(pos_embed, self.patch_embed.grid_size, feature_map)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((x[:, :pos], cls, x[:, pos:]), dim=1)
        return self.pos_drop(x + pos_embed), grid

    def _block_step(self, i: int, hidden: torch.Tensor, residual: Optional[torch.Tensor]):
        """Block i on (the previous block's mixer output, the stream before it) -> the same pair after it: the
        published loop, whose block i adds block i-1's output to the stream through its own stochastic depth."""
        return self.layers[i](hidden, residual)

    def _run_block(self, i: int, hidden: torch.Tensor, residual: Optional[torch.Tensor]):
        if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
            return torch.utils.checkpoint.checkpoint(self._block_step, i, hidden, residual, use_reentrant=False)
        return self._block_step(i, hidden, residual)

    def _join(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], last: int, norm: bool):
        """(norm_f of the stream or None, the stream after block `last`, fp32 or wider), from that block's pair:
        its mixer output joins through the next block's stochastic depth (``self.drop_path`` after the last
        block), as the next block would add it; with ``norm``, the add and norm_f in one kernel on GPUs."""
        scale = None
        if residual is not None:
            join = self.layers[last + 1].drop_path if last + 1 < len(self.layers) else self.drop_path
            hidden, scale = _join_scale(join, hidden)
        if norm and isinstance(self.norm_f, RMSNorm):
            return add_rms_norm(hidden, residual, self.norm_f.weight, self.norm_f.eps, scale=scale)
        hidden = scaled_by_sample(hidden, scale)
        stream = at_least_fp32(hidden if residual is None else residual + hidden)
        return (self.norm_f(stream) if norm else None), stream

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (batch, C, H, W) -> normalised tokens (batch, num_patches + 1, embed_dim), class token in the
        middle."""
        hidden, residual = self._embed(x)[0], None
        for i in range(len(self.layers)):
            hidden, residual = self._run_block(i, hidden, residual)
        # both unpacked, so that torch.fx lists the final stream as a node too (feature extraction)
        normed, _stream = self._join(hidden, residual, len(self.layers) - 1, norm=True)
        return normed

    def _split_tokens(self, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(batch, num_patches + 1, C) -> (patch tokens (batch, num_patches, C), class token (batch, 1, C))."""
        pos = self._cls_index(tokens)
        return torch.cat((tokens[:, :pos], tokens[:, pos + 1:]), dim=1), tokens[:, pos:pos + 1]

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
            return_prefix_tokens: bool = False,
    ):
        """Forward that also returns per-block feature maps (timm's API, as in its VisionTransformer).

        An intermediate of block i is the **residual stream after block i**: the sum of the embedded tokens and
        the mixer outputs of blocks 0..i (each through its stochastic depth), i.e. exactly the tensor block i+1
        normalises — or, for the last block, the tensor ``norm_f`` normalises to give ``forward_features``. It is
        kept in fp32 (or wider) like the residual stream itself; ``norm=True`` applies ``norm_f`` to each (in the
        weights' dtype). The class token, which Vim places in the middle of the sequence (index
        ``token_position``), is removed, so NCHW maps are (batch, embed_dim, *grid), grid being
        ``patch_embed.grid_size`` (with dynamic_img_size: the input's own grid), with the patches in raster
        order; ``return_prefix_tokens=True`` also returns it, as (map, class token) pairs.

        Args:
            x: images (batch, C, H, W).
            indices: the last n blocks if int, all if None, these block indices (negative from the end) if a list.
            norm: apply the final norm to every intermediate.
            stop_early: stop running blocks after the last requested one (with ``intermediates_only``).
            output_fmt: "NCHW" (maps) or "NLC" (patch tokens).
            intermediates_only: return only the intermediates.
            return_prefix_tokens: pair each intermediate with its class token (batch, 1, C).
        Returns:
            A list of intermediates, or (forward_features output, intermediates).
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        last = max_index if stop_early and intermediates_only else len(self.layers) - 1
        intermediates = []
        hidden, grid = self._embed(x)
        residual = None
        for i in range(last + 1):
            hidden, residual = self._run_block(i, hidden, residual)
            if i - 1 in take_indices:  # block i normalised the stream after block i-1
                intermediates.append(self.norm_f(residual) if norm else residual)
        wants_norm = not intermediates_only or (norm and last in take_indices)
        normed, stream = self._join(hidden, residual, last, norm=wants_norm)
        if last in take_indices:
            intermediates.append(normed if norm else stream)

        prefix_tokens = []
        maps = []
        for y in intermediates:
            patches, cls = self._split_tokens(y)
            prefix_tokens.append(cls)
            if output_fmt == "NCHW":
                patches = patches.unflatten(1, grid).permute(0, 3, 1, 2).contiguous()
            maps.append(patches)
        intermediates = list(zip(maps, prefix_tokens)) if return_prefix_tokens else maps
        if intermediates_only:
            return intermediates
        return normed, intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the blocks after the last of `indices` (and the final norm / the head if asked); returns the
        absolute indices to take, as timm's models do."""
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        if max_index + 1 < len(self.layers):
            # The last kept block's mixer output joined the stream through the next block's stochastic depth.
            self.drop_path = self.layers[max_index + 1].drop_path
        self.layers = self.layers[:max_index + 1]
        self.depth = len(self.layers)
        if prune_norm:
            self.norm_f = nn.Identity()
        if prune_head:
            self.reset_classifier(0)
        return take_indices

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, self._cls_index(x)]
        return x if pre_logits else self.head(x)

    @torch.jit.ignore
    def split_sequence(self, forward=None) -> None:
        """Make ``model(images)`` call ``forward(model, images)`` instead of the unsplit forward (None restores it).
        Sequence parallelism sets it (``models.sequence_parallel.split_over``), so that an engine that calls the
        model (DeepSpeed's, with its hooks and autocast) runs the split; state dict and parameters are unchanged."""
        self._sequence_split = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._sequence_split is not None:
            return self._sequence_split(self, x)
        return self.forward_head(self.forward_features(x))


# ---------------------------------------------------------------------------------------------------------------
# Loading foreign weights
# ---------------------------------------------------------------------------------------------------------------

def resample_pos_embed(pos_embed: torch.Tensor, old_grid, new_grid) -> torch.Tensor:
    """Bicubic resize of the patch position embeddings; the middle class token's embedding moves to the new middle."""
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid == new_grid:
        return pos_embed
    n_old = old_grid[0] * old_grid[1]
    mid = n_old // 2
    cls = pos_embed[:, mid:mid + 1]
    patches = torch.cat((pos_embed[:, :mid], pos_embed[:, mid + 1:]), dim=1)
    dim = patches.shape[-1]
    grid = patches.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(at_least_fp32(grid), size=new_grid, mode="bicubic", align_corners=False)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    new_mid = new_grid[0] * new_grid[1] // 2
    return torch.cat((patches[:, :new_mid], cls, patches[:, new_mid:]), dim=1)


def _pos_embed_for_map(pos_embed: torch.Tensor, built_grid, feature_map: torch.Tensor) -> torch.Tensor:
    """dynamic_img_size: the position embeddings for the token grid of `feature_map` (batch, C, *grid), resampled
    when it is not the grid the model was built for (the class token's moves to the middle of that sequence)."""
    return resample_pos_embed(pos_embed, built_grid, feature_map.shape[-2:])


torch.fx.wrap("_pos_embed_for_map")


def _square_grid(num_tokens: int):
    side = math.isqrt(num_tokens - 1)
    if side * side != num_tokens - 1:
        raise ValueError(f"cannot infer the patch grid of a pos_embed with {num_tokens} tokens "
                         f"(expected a square grid plus one class token)")
    return side, side


def checkpoint_filter_fn(state_dict: dict, model: VisionMamba) -> dict:
    """Adapt a published-format state dict to `model`: unwrap {"model": ...}, drop a DDP "module." prefix,
    resample position embeddings to the model's patch grid, and drop the head when the class count differs
    (it is then re-initialised by the loader, as timm does for finetuning)."""
    if "model" in state_dict and isinstance(state_dict["model"], dict):
        state_dict = state_dict["model"]
    state_dict = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    out = dict(state_dict)
    pos = out.get("pos_embed")
    if pos is not None and pos.shape != model.pos_embed.shape:
        out["pos_embed"] = resample_pos_embed(pos, _square_grid(pos.shape[1]), model.patch_embed.grid_size)
    head_w = out.get("head.weight")
    if head_w is not None and (not isinstance(model.head, nn.Linear) or head_w.shape[0] != model.num_classes):
        out.pop("head.weight", None)
        out.pop("head.bias", None)
    return out


def load_state_dict_into(model: VisionMamba, state_dict: dict, strict: bool = True):
    """checkpoint_filter_fn + load_state_dict; a dropped head is re-initialised and allowed to be missing.

    Mismatched keys or shapes raise ValueError listing them (what users need to see to fix a wrong --model).
    """
    filtered = checkpoint_filter_fn(state_dict, model)
    expected = model.state_dict()
    head_dropped = "head.weight" not in filtered and "head.weight" in expected
    missing = sorted(k for k in expected if k not in filtered and not (head_dropped and k.startswith("head.")))
    unexpected = sorted(k for k in filtered if k not in expected)
    wrong_shape = sorted(f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
                         for k, v in filtered.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape))
    if strict and (missing or unexpected or wrong_shape):
        problems = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong_shape)):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                problems.append(f"{label}: {shown}")
        raise ValueError("checkpoint does not match the model: " + "; ".join(problems))
    if head_dropped:
        model.reset_classifier(model.num_classes)
    filtered = {k: v for k, v in filtered.items() if k in expected and tuple(v.shape) == tuple(expected[k].shape)}
    model.load_state_dict(filtered, strict=False)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Published variants, registered in timm
# ---------------------------------------------------------------------------------------------------------------

def _cfg(hf_hub_id="", hf_hub_filename="", top1=None, **kwargs):
    return {
        "hf_hub_id": hf_hub_id, "hf_hub_filename": hf_hub_filename, "num_classes": 1000,
        "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 0.875, "interpolation": "bicubic",
        "fixed_input_size": True, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
        "first_conv": "patch_embed.proj", "classifier": "head", "paper_ids": "arXiv:2401.09417",
        "paper_name": "Vision Mamba: Efficient Visual Representation Learning with Bidirectional State Space Model",
        "origin_url": "https://github.com/hustvl/Vim", "license": "apache-2.0",
        "notes": (f"ImageNet-1k top-1 {top1}",) if top1 else (), **kwargs,
    }


# name -> (architecture args, alias, default pretrained cfg). One table for every published variant.
VARIANTS = {
    "vim_tiny_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2": (
        dict(patch_size=16, stride=16, embed_dim=192, depth=24), "vim_tiny",
        _cfg("hustvl/Vim-tiny-midclstok", "vim_t_midclstok_76p1acc.pth", top1=76.1)),
    "vim_tiny_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2": (
        dict(patch_size=16, stride=8, embed_dim=192, depth=24), "vim_tiny_s8",
        _cfg("hustvl/Vim-tiny-midclstok", "vim_t_midclstok_ft_78p3acc.pth", top1=78.3)),
    "vim_small_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2": (
        dict(patch_size=16, stride=16, embed_dim=384, depth=24), "vim_small",
        _cfg("hustvl/Vim-small-midclstok", "vim_s_midclstok_80p5acc.pth", top1=80.5)),
    "vim_small_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2": (
        dict(patch_size=16, stride=8, embed_dim=384, depth=24), "vim_small_s8",
        _cfg("hustvl/Vim-small-midclstok", "vim_s_midclstok_ft_81p6acc.pth", top1=81.6)),
    "vim_base_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_middle_cls_token_div2": (
        dict(patch_size=16, stride=16, embed_dim=768, depth=24), "vim_base",
        _cfg("hustvl/Vim-base-midclstok", "vim_b_midclstok_81p9acc.pth", top1=81.9)),
}
ALIASES = {alias: name for name, (_, alias, _) in VARIANTS.items()}


def _create(variant: str, pretrained: bool = False, **kwargs) -> VisionMamba:
    arch = dict(VARIANTS[ALIASES.get(variant, variant)][0])
    arch.update(kwargs)  # depth=, embed_dim=, img_size=, ... override the published defaults
    # features_only: the last 3 blocks unless told, as timm's ViT
    out_indices = arch.pop("out_indices", 3)
    feature_cls = arch.pop("feature_cls", "getter")
    if arch.get("features_only") and feature_cls != "getter":
        raise ValueError(f"Vim's features come from forward_intermediates (feature_cls='getter'); "
                         f"feature_cls={feature_cls!r} is not supported (its blocks return (hidden, residual) "
                         f"pairs, not feature maps)")
    return build_model_with_cfg(VisionMamba, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **arch)


def _default_cfgs():
    cfgs = {}
    for name, (_, alias, cfg) in VARIANTS.items():
        cfgs[name] = cfg
        cfgs[alias] = cfg
    return generate_default_cfgs(cfgs)


# timm's register_model reads the module's `default_cfgs`, so it must exist before the factories are registered.
default_cfgs = _default_cfgs()


def _register_all():
    for name in list(VARIANTS) + list(ALIASES):
        def factory(pretrained=False, _name=name, **kwargs):
            return _create(_name, pretrained=pretrained, **kwargs)

        factory.__name__ = name
        factory.__qualname__ = name
        factory.__module__ = __name__
        factory.__doc__ = f"Vision Mamba `{ALIASES.get(name, name)}` (published architecture)."
        register_model(factory)


_register_all()
