"""Vision Mamba with its token sequence split over the ranks of a process group: sequence parallelism (issue 38).

One image's tokens no longer need to fit on one rank: each rank of the group holds a contiguous chunk of the token
sequence and runs every block on it, and the result (logits, and after ``average_gradients`` every gradient) equals
the unsplit model's up to rounding. Parameters are replicated on every rank of the group.

The split
    The sequence is the one the unsplit model's blocks see: patch tokens, the class token inserted in the middle
    (``VisionMamba.token_position``), position embeddings added. ``split_bounds`` cuts its T tokens into W
    contiguous chunks in rank order, the first ``T mod W`` ranks one token longer (as ``torch.tensor_split``);
    any other lengths (each at least one token) can be given. Every rank embeds the whole image (one conv, the
    model's own ``_embed``, random draws included) and keeps its chunk: the random draws of ``pos_drop`` and of
    stochastic depth are then those of the unsplit model whenever the group's ranks share their RNG state.

Per block, on each rank (B batch, D = d_inner channels, N = d_state, K = d_conv, W ranks, L_r its chunk):
    * norm, in_proj, x_proj, dt_proj, the gates and out_proj act token by token: local.
    * The causal depthwise conv of the forward direction reads the K-1 tokens before the chunk, the anti-causal
      conv of the flipped direction the K-1 after it. Collective 1, ``all_gather`` of every rank's edges: its first
      and last K-1 tokens of x (both directions convolve the same x), (B, D, 2(K-1)) per rank. A chunk shorter
      than K-1 tokens is fine: the halo is assembled from as many ranks as it takes, zeros beyond the sequence's
      ends (the unsplit conv's padding).
    * Each direction forms its chunk's pair (P, S) (``vim_ds/ops/scan_chunks.py``: P = exp(A * sum of delta'),
      S = the state a scan of the chunk from zero leaves). Collective 2, ``all_gather`` of both directions'
      pairs, (4, B, D, N) per rank. Locally: the state the chunk starts from (``initial_states``: the combine of
      the pairs of the ranks before it; for the flipped direction of the ranks after it). Then two kernel passes
      (``selective_scan_with_state``, which vim_ds's CPU and GPU kernels and the reference run; mamba_ssm's kernel,
      a comparison backend without an initial state, is refused): S is the last state of a first scan from zero
      (without D and the gate), and the output a second scan from the passed state; its backward hands dh0
      back through the gather to the other ranks' S, whose gradient enters the first pass's backward. (LASP-2
      scans once and adds what the passed state changes, ``vim_ds/ops/scan_chunks.py``'s ``state_correction``:
      in PyTorch over (B, D, L_r, N) tensors that made the split about 20x slower on the CPU; docs/sequence-
      parallel.md.)
    * So per block each rank contributes 2(K-1)·B·D elements (the activations' dtype) and 4·B·D·N (float32;
      float64 for a float64 model) to two all-gathers and receives the W-1 other ranks' contributions; none of it
      grows with the number of tokens. The backward all-reduces the gathered
      gradients, W times a contribution (gloo has no reduce-scatter, which would need only one).
    * Every rank reads another rank's slot of both gathers (the ranks before it for the forward direction, after it
      for the flipped one), so every rank's backward reaches both collectives: a rank whose loss did not depend on a
      gather would skip its backward while the others wait in it.
The head: the class token's rank broadcasts the class token's residual stream (B, embed_dim) (collective 3, once
per forward; its backward an all-reduce of the same size); every rank applies the final norm and the head, so the
logits are on every rank.

Gradients
    Every collective is a small autograd Function whose backward is its adjoint (gather -> sum of the gathered
    gradients back to each rank's slot; broadcast -> sum of every rank's gradient to the owner), so the state's
    gradient travels back the other way, from a chunk to those before it. If every rank computes the same loss
    from its (identical) logits and calls ``backward()``, the gradients summed over the group are W times the
    unsplit model's: ``average_gradients`` (all-reduce SUM, divide by W) leaves the unsplit model's gradient on
    every rank. An engine that averages over all data × sequence-parallel ranks (DeepSpeed with
    ``sequence_parallel_size``) gets the same without it.

Memory
    Each direction's two passes (the first with the pair, the second from the passed state) run under activation
    checkpointing, with no collective inside, so a rank keeps x, z, the halos and the states per block (as the
    unsplit model's fused branch keeps x and z), not the scan's inputs, which are recomputed in backward.

``split_over(model, group)`` makes ``model(images)`` run the split, which is how `vim-ds train --sequence-parallel N`
uses it (vim_ds/engine/sequence_groups.py: the groups, and what DeepSpeed is told).

Not here: the model's gradient checkpointing with the split (refused: its recomputation would repeat the
collectives).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..ops.library import resolve
from ..ops.scan_chunks import decay_product, initial_states
from ..ops.scan_state import selective_scan_with_state
from ..ops.ssm_branch import conv1d_silu, project
from .vim import BiMambaMixer, VisionMamba, _at_least_fp32

__all__ = ["average_gradients", "sequence_parallel_forward", "split_bounds", "split_over"]

Bounds = List[Tuple[int, int]]


def split_bounds(length: int, world: int, lengths: Optional[Sequence[int]] = None) -> Bounds:
    """[start, end) of each rank's chunk of a `length`-token sequence over `world` ranks, in rank order.

    By default as even as it gets, the first ``length % world`` chunks one token longer; `lengths` gives them
    instead (one per rank, each at least 1, summing to `length`)."""
    if lengths is None:
        if world < 1 or length < world:
            raise ValueError(f"cannot split {length} tokens over {world} ranks: every rank needs at least one token")
        base, extra = divmod(length, world)
        lengths = [base + 1 if r < extra else base for r in range(world)]
    lengths = [int(n) for n in lengths]
    if len(lengths) != world or min(lengths) < 1 or sum(lengths) != length:
        raise ValueError(f"chunk lengths {lengths} must be {world} numbers, each at least 1, summing to {length}")
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


# -- collectives with their adjoints as backward ----------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    """Every rank's x stacked in rank order, (W, *x.shape); backward: this rank's slot of the gradients summed over
    the group (an all-reduce of the whole stack: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _FromOwner(torch.autograd.Function):
    """The owner rank's x on every rank (a broadcast). Other ranks pass a stand-in of the same shape that is part of
    their graph, so that every rank's backward reaches this collective; backward: the owner's x gets the sum of all
    ranks' gradients, the stand-ins get zeros."""

    @staticmethod
    def forward(ctx, x, owner, group):
        ctx.group, ctx.is_owner = group, dist.get_rank(group) == owner
        out = x.detach().clone().contiguous()
        dist.broadcast(out, src=dist.get_global_rank(group, owner), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return (grad if ctx.is_owner else torch.zeros_like(grad)), None, None


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


# -- the conv halo ----------------------------------------------------------------------------------------------

def _edges(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, D, 2h): the chunk's first h tokens, then its last h, each zero-filled on the inside when it is shorter."""
    n = min(h, x.shape[-1])
    first = F.pad(x[..., :n], (0, h - n))
    last = F.pad(x[..., x.shape[-1] - n:], (h - n, 0))
    return torch.cat((first, last), dim=-1)


def _halos(edges: torch.Tensor, bounds: Bounds, rank: int, h: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(before, after), each (B, D, h): the h tokens before this rank's chunk and the h after it, from every rank's
    edges (W, B, D, 2h); zeros beyond the sequence's ends, as the unsplit conv pads."""
    real = [min(h, end - start) for start, end in bounds]
    zeros = edges.new_zeros(edges.shape[1:-1] + (h,))
    before = [edges[j][..., 2 * h - real[j]:] for j in range(rank)]
    after = [edges[j][..., :real[j]] for j in range(rank + 1, len(bounds))]
    return torch.cat([zeros] + before, dim=-1)[..., -h:], torch.cat(after + [zeros], dim=-1)[..., :h]


# -- the mixer and the blocks -----------------------------------------------------------------------------------

class _Context:
    """What every block needs to know about the split: the group, this rank, the chunk bounds and the scan backend,
    which must scan from an initial state and return its gradient (``selective_scan_with_state``): vim_ds's own
    (the reference, the CPU and the GPU kernels) do; mamba_ssm's kernel, a comparison backend, does not."""

    def __init__(self, group, bounds: Bounds, backend: str, device: torch.device):
        impl = resolve(backend, device)
        if not hasattr(impl, "fwd_state"):
            raise ValueError(f"the sequence split needs a scan that starts from a given state: the {impl.name} "
                             f"backend has none (use vim_ds's own: auto, ref, cpu or cuda)")
        self.group, self.bounds, self.backend = group, bounds, backend
        self.rank = dist.get_rank(group)


class _Direction:
    """One direction of a mixer on this rank's chunk x (batch, D, L_r), given its conv halo (batch, D, K-1): the
    tokens before the chunk, or with ``reverse`` after it.

    Its two pieces each run under activation checkpointing (non-reentrant; no collective inside), so that what
    autograd keeps is x, z (both shared by the two directions), the halo and the initial state, as the fused branch
    keeps x and z: the scan's inputs are recomputed in backward instead."""

    def __init__(self, mixer: BiMambaMixer, reverse: bool, backend: str):
        suffix = "_b" if reverse else ""
        self.conv = getattr(mixer, "conv1d" + suffix)
        self.x_proj, self.dt_proj = getattr(mixer, "x_proj" + suffix), getattr(mixer, "dt_proj" + suffix)
        self.A_log = mixer.A_b_log if reverse else mixer.A_log
        self.D = mixer.D_b if reverse else mixer.D
        self.d_state, self.reverse, self.backend = mixer.d_state, reverse, backend

    def _inputs(self, x, halo):
        """The scan's u, delta, B, C and A, as the fused branch computes them."""
        h, length = halo.shape[-1], x.shape[-1]
        x_ext, chunk = (torch.cat((x, halo), -1), slice(0, length)) if self.reverse else \
            (torch.cat((halo, x), -1), slice(h, h + length))
        u = conv1d_silu(x_ext, self.conv.weight, self.conv.bias, self.backend, self.reverse)[..., chunk]
        u = u.contiguous()
        dt_rank = self.dt_proj.weight.shape[1]
        x_dbl = project(self.x_proj.weight, u)
        delta = project(self.dt_proj.weight, x_dbl[:, :dt_rank]).contiguous()
        B = x_dbl[:, dt_rank:dt_rank + self.d_state].contiguous()
        C = x_dbl[:, dt_rank + self.d_state:].contiguous()
        return u, delta, B, C, -torch.exp(_at_least_fp32(self.A_log))

    def _pair(self, x, halo):
        u, delta, B, C, A = self._inputs(x, halo)
        bias = self.dt_proj.bias
        # The last state depends on neither D nor the gate: the first pass leaves them out.
        _, S = selective_scan_with_state(u, delta, A, B, C, None, None, bias, True, self.reverse,
                                         backend=self.backend)
        return decay_product(delta, A, bias, True), S

    def _from_state(self, x, halo, z, h_in):
        u, delta, B, C, A = self._inputs(x, halo)
        out, _ = selective_scan_with_state(u, delta, A, B, C, self.D, z, self.dt_proj.bias, True, self.reverse, h_in,
                                           backend=self.backend)
        return out

    def pair(self, x, halo):
        """First pass: the chunk's (P, S), S by the kernel scanning from zero."""
        return checkpoint(self._pair, x, halo, use_reentrant=False)

    def from_state(self, x, halo, z, h_in):
        """Second pass: the chunk's output scanned by the kernel from h_in."""
        return checkpoint(self._from_state, x, halo, z, h_in, use_reentrant=False)


def _start_states(gathered: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's initial states (forward direction, flipped direction) from every rank's pairs (W, 4, B, D, N):
    the forward one from the ranks before it (a prefix), the flipped one from the ranks after it (a suffix)."""
    forward = initial_states([(g[0], g[1]) for g in gathered])[rank]
    flipped = initial_states([(g[2], g[3]) for g in gathered], reverse=True)[rank]
    return forward, flipped


def _mixer(mixer: BiMambaMixer, hidden: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """BiMambaMixer.forward on this rank's chunk of `hidden` (batch, L_r, d_model): the same arithmetic, with the
    conv's halo and the scans' states from the other ranks."""
    hidden_t = hidden.transpose(1, 2)
    w_x, w_z = mixer.in_proj.weight.chunk(2, dim=0)
    x, z = project(w_x, hidden_t), project(w_z, hidden_t)
    if mixer.in_proj.bias is not None:
        b_x, b_z = mixer.in_proj.bias.chunk(2)
        x, z = x + b_x[:, None], z + b_z[:, None]
    z = z.contiguous()
    h = mixer.d_conv - 1
    if h > 0:
        before, after = _halos(_gather(_edges(x, h), ctx.group), ctx.bounds, ctx.rank, h)
    else:
        before = after = x[..., :0]
    forward, flipped = _Direction(mixer, False, ctx.backend), _Direction(mixer, True, ctx.backend)
    pair_f, pair_b = forward.pair(x, before), flipped.pair(x, after)
    h_f, h_b = _start_states(_gather(torch.stack((*pair_f, *pair_b)), ctx.group), ctx.rank)
    out_f, out_b = forward.from_state(x, before, z, h_f), flipped.from_state(x, after, z, h_b)
    w_out = mixer.out_proj.weight * 0.5 if mixer.divide_out else mixer.out_proj.weight
    out = project(w_out, (out_f + out_b).to(x.dtype)).transpose(1, 2)
    return out if mixer.out_proj.bias is None else out + mixer.out_proj.bias


def _block_step(model: VisionMamba, i: int, stream: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """VisionMamba._block_step on this rank's chunk of the residual stream."""
    layer = model.layers[i]
    residual = _at_least_fp32(stream)
    hidden = _mixer(layer.mixer, layer.norm(residual), ctx)
    join = model.layers[i + 1].drop_path if i + 1 < len(model.layers) else model.drop_path
    return residual + join(hidden)


def sequence_parallel_forward(model: VisionMamba, images: torch.Tensor, group=None, *, backend: str = "auto",
                              lengths: Optional[Sequence[int]] = None, pre_logits: bool = False) -> torch.Tensor:
    """``model(images)`` with the token sequence split over `group` (default: the whole world): every rank of the
    group calls it with the same model and images and gets the same logits (batch, num_classes), or with
    ``pre_logits`` the normalised class token. See the module docstring for the scheme.

    backend: the scan and conv backend (auto, ref, cpu, cuda), as the ops take it. lengths: each rank's number of
    tokens (default ``split_bounds``'s even split)."""
    group = dist.group.WORLD if group is None else group
    if model.grad_checkpointing and torch.is_grad_enabled():
        raise NotImplementedError("sequence_parallel_forward does not run with gradient checkpointing (its "
                                  "recomputation would repeat the collectives); turn set_grad_checkpointing off")
    tokens, _ = model._embed(images)
    cls_index = model._cls_index(tokens)
    ctx = _Context(group, split_bounds(tokens.shape[1], dist.get_world_size(group), lengths), backend,
                   tokens.device)
    start, end = ctx.bounds[ctx.rank]
    stream = tokens[:, start:end].clone()
    for i in range(len(model.layers)):
        stream = _block_step(model, i, stream, ctx)
    owner = next(r for r, (s, e) in enumerate(ctx.bounds) if s <= cls_index < e)
    mine = stream[:, cls_index - start] if ctx.rank == owner else stream[:, 0]
    cls = model.norm_f(_FromOwner.apply(mine, owner, group))
    return cls if pre_logits else model.head(cls)


def average_gradients(tensors, group=None) -> None:
    """Replace each tensor's ``.grad`` by its average over the group's ranks (all-reduce SUM, then / W; a missing
    gradient counts as zeros), in the order given, which must be the same on every rank. After every rank's
    ``backward()`` of the same loss through ``sequence_parallel_forward``, this leaves the unsplit model's
    gradient of every parameter (and of the images, if they require it) on every rank."""
    group = dist.group.WORLD if group is None else group
    world = dist.get_world_size(group)
    for t in tensors:
        grad = torch.zeros_like(t) if t.grad is None else t.grad.contiguous()
        dist.all_reduce(grad, group=group)
        t.grad = grad / world


def split_over(model: VisionMamba, group, *, backend: str = "auto") -> VisionMamba:
    """From now on ``model(images)`` is ``sequence_parallel_forward(model, images, group)`` (what an engine that
    calls the model needs: the training engine's ZeRO hooks and autocast stay around it). Returns the model."""
    def forward(module: VisionMamba, images: torch.Tensor) -> torch.Tensor:
        return sequence_parallel_forward(module, images, group, backend=backend)

    model.split_sequence(forward)
    return model

