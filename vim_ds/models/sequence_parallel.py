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
      the pairs of the ranks before it; for the flipped direction of the ranks after it). Two kernel passes in
      forward (vim_ds's CPU and GPU kernels and the reference scan from a given state; mamba_ssm's kernel, a
      comparison backend without one, is refused): the first, from zero, gives S; the second, from the passed
      state, the output. (LASP-2 scans once and adds what the passed state changes, ``scan_chunks``'s
      ``state_correction``: in PyTorch over (B, D, L_r, N) tensors that made the split about 20x slower on the CPU.)
    * Both directions' scans are one autograd Function, ``_MixerScans``, with its own backward: the scan's inputs
      recomputed from x and the halos; each direction's gradient of its initial state from this rank's output
      alone, g (one reverse pass of the kernel, ``h0_grad``); collective 3, ``all_gather`` of both g's, (2, B, D,
      N) per rank; the gradient of each direction's last state, G, by the same combine the other way
      (``_last_state_grads``: rank r's last state is rank r+1's initial state, whose gradient is g_{r+1} plus P_{r+1}
      times rank r+1's own G); then one scan backward per direction, from the initial state, with G as its last
      state's gradient. That one backward is the whole gradient of the chunk's inputs, through its output and
      through its S and P (which reach the later ranks only as its last state, S + P h0), so the chunk is scanned
      twice forward and once backward, plus the cheap g pass. ``_mixer_autograd`` is the same scheme composed of
      differentiable ops with autograd's backward (three forward scans and two backward per direction, every
      intermediate kept): the reference the Function is tested against.
    * So per block each rank contributes 2(K-1)·B·D elements (the activations' dtype), 4·B·D·N and, in backward,
      2·B·D·N (float32; float64 for a float64 model) to three all-gathers and receives the W-1 other ranks'
      contributions; none of it grows with the number of tokens. The conv edges' backward all-reduces their
      gathered gradients, W times a contribution (gloo has no reduce-scatter, which would need only one).
    * Every rank reads another rank's slot of every gather (the ranks before it for the forward direction, after it
      for the flipped one), so every rank's backward reaches every collective: a rank whose loss did not depend on
      a gather would skip its backward while the others wait in it.
The head: the class token's rank broadcasts the class token's residual stream (B, embed_dim) (once per forward;
its backward an all-reduce of the same size); every rank applies the final norm and the head, so the logits are on
every rank.

Gradients
    The conv edges' gather and the class token's broadcast are small autograd Functions whose backward is their
    adjoint (a gather's: the sum of the gathered gradients back to each rank's slot; the broadcast's: the sum of
    every rank's gradient to the owner); the states' gradients travel inside ``_MixerScans``'s backward, from a
    chunk to those before it (the flipped direction: after it). If every rank computes the same loss from its
    (identical) logits and calls ``backward()``, the gradients summed over the group are W times the unsplit
    model's: ``average_gradients`` (all-reduce SUM, divide by W) leaves the unsplit model's gradient on every
    rank. An engine that averages over all data × sequence-parallel ranks gets the same without it.

Memory
    ``_MixerScans`` keeps x, z, the halos, the two initial states and every rank's P per block (as the unsplit
    model's fused branch keeps x and z), not the scan's inputs: its backward recomputes them.

``split_over(model, group)`` makes ``model(images)`` run the split, which is how `vim-ds train --sequence-parallel N`
uses it (vim_ds/runtime/sequence_groups.py: the groups, and what DeepSpeed is told).

Not here: the model's gradient checkpointing with the split (refused: its recomputation would repeat the
collectives).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops.library import branch_inputs_bwd, branch_inputs_fwd, resolve
from ..ops.rms_norm import at_least_fp32
from ..ops.scan_chunks import decay_product, initial_states
from ..ops.scan_state import selective_scan_with_state
from ..ops.ssm_branch import branch_inputs, project
from .vim import BiMambaMixer, VisionMamba

__all__ = ["average_gradients", "sequence_parallel_forward", "split_bounds", "split_error", "split_over"]

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


def split_error(model, ranks: int) -> str | None:
    """Why `model`'s tokens cannot be split over `ranks` ranks, in a few words, else None: only a VisionMamba has
    the split, and every rank needs at least one of its tokens (its patches and the class token). Checked before
    anything starts (the training preflight, `vim-ds bench split`'s arguments), so that a job is refused in one line
    instead of failing inside its first forward; `model` may be built on the meta device."""
    if ranks <= 1:
        return None
    if not isinstance(model, VisionMamba):
        return (f"only Vim models split their tokens over ranks, and this one is a {type(model).__name__} (use a "
                f"vim_* model, or no split)")
    patches = model.patch_embed.num_patches
    if patches + 1 < ranks:
        return (f"its {patches + 1} tokens ({patches} patch{'es' * (patches != 1)} and the class token) cannot be "
                f"split over {ranks} ranks: every rank needs at least one token (a larger --input-size, or fewer "
                f"ranks per image)")
    return None


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
        self.group, self.bounds, self.backend, self.impl = group, bounds, backend, impl
        self.rank = dist.get_rank(group)


def _direction_weights(mixer: BiMambaMixer, reverse: bool) -> tuple:
    """One direction's conv weight and bias, x_proj and dt_proj weights, dt_proj bias, A_log and D, read from the
    mixer's modules at each use (under ZeRO-3 such a read is what gathers a partitioned parameter)."""
    s = "_b" if reverse else ""
    conv, x_proj, dt_proj = getattr(mixer, "conv1d" + s), getattr(mixer, "x_proj" + s), getattr(mixer, "dt_proj" + s)
    return (conv.weight, conv.bias, x_proj.weight, dt_proj.weight, dt_proj.bias,
            mixer.A_b_log if reverse else mixer.A_log, mixer.D_b if reverse else mixer.D)


def _scan_params(weights, like: torch.Tensor):
    """A = -exp(A_log), D and dt_proj's bias in the scan's parameter dtype (float32; float64 for float64 input)."""
    wide = torch.float64 if like.dtype == torch.float64 else torch.float32
    *_, bias, A_log, D = weights
    return -torch.exp(A_log.to(wide)), D.to(wide), bias.to(wide)


def _start_states(gathered: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's initial states (forward direction, flipped direction) from every rank's pairs (W, 4, B, D, N):
    the forward one from the ranks before it (a prefix), the flipped one from the ranks after it (a suffix)."""
    forward = initial_states([(g[0], g[1]) for g in gathered])[rank]
    flipped = initial_states([(g[2], g[3]) for g in gathered], reverse=True)[rank]
    return forward, flipped


def _last_state_grads(decays: torch.Tensor, grads: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of this rank's last states (forward direction, flipped direction) from every rank's decay
    products P and initial-state gradients g of its output, each (W, 2, B, D, N). The state's gradient runs the
    other way: rank r's last state is rank r+1's initial state, whose whole gradient is g_{r+1} + P_{r+1} times
    the gradient of rank r+1's last state, so the forward direction's comes from the ranks after this one (the
    combine of their (P, g) from the last one back), the flipped direction's from those before it."""
    forward = initial_states([(p[0], g[0]) for p, g in zip(decays, grads)], reverse=True)[rank]
    flipped = initial_states([(p[1], g[1]) for p, g in zip(decays, grads)])[rank]
    return forward, flipped


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x stacked in rank order (no autograd)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


class _MixerScans(torch.autograd.Function):
    """Both directions' SSM branches of one mixer on this rank's chunk: conv (with its halo), x_proj, dt_proj, the
    scan from the state the other ranks pass, the gate; ``out_f + out_b`` (batch, D, L_r).

    forward: each direction's scan inputs once; a first scan from zero gives the chunk's last state S (P from
    the sum of its delta'); one all-gather of both directions' (P, S); each direction's initial state h0 (a prefix
    combine, the flipped direction's a suffix); the second scan, from h0, gives the output. Kept for backward: x,
    z, the halos, the states h0, every rank's P (and the GPU kernel's chunk states), not the scan's inputs.

    backward: the inputs recomputed; each direction's g = the gradient of its h0 from this rank's output alone (one
    reverse pass, ``h0_grad``); one all-gather of both g's; the gradient of each direction's last state, G (the
    same combine the other way, ``_last_state_grads``); then one scan backward per direction, from h0, with G as
    its last state's gradient. That backward is the whole gradient of the chunk's inputs: through the output,
    and through S and P, which reach the later ranks only as the last state S + P h0 does. Its dh0 (g + P G) is
    not needed: h0 is made here from the gathered pairs, whose gradients are those same inputs' gradients on the
    ranks that formed them. So the chunk is scanned twice forward and once backward, plus the cheap g pass: the
    scheme through autograd (``_mixer_autograd``) scans it three times forward and twice backward."""

    @staticmethod
    def forward(ctx, x, z, before, after, split, *weights):
        impl, group, rank = split["impl"], split["group"], split["rank"]
        d_state = split["d_state"]
        with torch.autocast(x.device.type, enabled=False):  # every cast below is explicit, as in the fused ops
            prepared, pairs = [], []
            for reverse, halo, w in ((False, before, weights[:7]), (True, after, weights[7:])):
                u, _, delta, B, C, _ = branch_inputs_fwd(x, *w[:4], d_state, reverse, impl, halo)
                A, D, bias = _scan_params(w, x)
                # S does not depend on D or the gate: the first pass leaves them out
                _, _, S = impl.fwd_state(u, delta, A, B, C, None, None, bias, True, reverse, None)
                prepared.append((u, delta, B, C, A, D, bias))
                pairs += [impl.decay_product(delta, A, bias, True), S.to(A.dtype)]
            gathered = _all_gather(torch.stack(pairs), group)
            states = _start_states(gathered, rank)
            out, saved = 0, []
            for reverse, (u, delta, B, C, A, D, bias), h0 in zip((False, True), prepared, states):
                y, kept, _ = impl.fwd_state(u, delta, A, B, C, D, z, bias, True, reverse, h0.contiguous())
                out = out + y
                saved.append(x.new_empty(0) if kept is None else kept)
        ctx.split = split
        ctx.save_for_backward(x, z, before, after, *states, gathered[:, 0::2], *saved)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dout):
        x, z, before, after, h_f, h_b, decays, saved_f, saved_b = ctx.saved_tensors
        split = ctx.split
        impl, group, rank, d_state = split["impl"], split["group"], split["rank"], split["d_state"]
        mixer = split["mixer"]
        with torch.autocast(x.device.type, enabled=False):  # every cast below is explicit, as in the fused ops
            dout = dout.to(x.dtype).contiguous()
            runs = []
            for reverse, halo, h0, kept in ((False, before, h_f, saved_f), (True, after, h_b, saved_b)):
                w = _direction_weights(mixer, reverse)
                u, x_dbl, delta, B, C, pre = branch_inputs_fwd(x, *w[:4], d_state, reverse, impl, halo)
                A, D, bias = _scan_params(w, x)
                g = impl.h0_grad(u, delta, A, B, C, z, bias, dout, kept, True, reverse, h0.contiguous())
                runs.append((reverse, halo, h0, kept, w, u, x_dbl, delta, B, C, A, D, bias, pre, g))
            grads = _all_gather(torch.stack([r[-1].to(decays.dtype) for r in runs]), group)
            last_grads = _last_state_grads(decays, grads, rank)
            dx, dz, dhalos, dweights = 0, 0, [], []
            for (reverse, halo, h0, kept, w, u, x_dbl, delta, B, C, A, D, bias, pre, _), dlast in zip(runs, last_grads):
                du, ddelta, dA, dB, dC, dD, dz_r, dbias, _ = impl.bwd_state(
                    u, delta, A, B, C, D, z, bias, dout, kept, True, reverse, h0.contiguous(),
                    dlast.to(A.dtype).contiguous())
                dx_r, dhalo, dconv_w, dconv_b, dx_proj_w, ddt_proj_w = branch_inputs_bwd(
                    x, u, x_dbl, du, ddelta, dB, dC, *w[:4], reverse, impl, halo, pre)
                conv_w, conv_b, _, _, dt_bias, A_log, D_param = w
                dx, dz = dx + dx_r, dz + dz_r
                dhalos.append(dhalo)
                # A = -exp(A_log): dA_log = dA * A
                dweights += [dconv_w, dconv_b, dx_proj_w, ddt_proj_w, dbias.to(dt_bias.dtype),
                             (dA * A).to(A_log.dtype), dD.to(D_param.dtype)]
        return (dx.to(x.dtype), dz.to(z.dtype), *dhalos, None, *dweights)


def _mixer(mixer: BiMambaMixer, hidden: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """BiMambaMixer.forward on this rank's chunk of `hidden` (batch, L_r, d_model): the same arithmetic, with the
    conv's halo and the scans' states from the other ranks (``_MixerScans``)."""
    x, z = _in_proj(mixer, hidden)
    before, after = _conv_halos(mixer, x, ctx)
    split = {"impl": ctx.impl, "group": ctx.group, "rank": ctx.rank, "d_state": mixer.d_state, "mixer": mixer}
    out = _MixerScans.apply(x, z, before, after, split, *_direction_weights(mixer, False),
                            *_direction_weights(mixer, True))
    return _out_proj(mixer, out)


def _in_proj(mixer: BiMambaMixer, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    hidden_t = hidden.transpose(1, 2)
    w_x, w_z = mixer.in_proj.weight.chunk(2, dim=0)
    x, z = project(w_x, hidden_t), project(w_z, hidden_t)
    if mixer.in_proj.bias is not None:
        b_x, b_z = mixer.in_proj.bias.chunk(2)
        x, z = x + b_x[:, None], z + b_z[:, None]
    return x, z.contiguous()


def _conv_halos(mixer: BiMambaMixer, x: torch.Tensor, ctx: _Context) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K-1 tokens of x before this rank's chunk and the K-1 after it (collective 1)."""
    h = mixer.d_conv - 1
    if h == 0:
        return x[..., :0], x[..., :0]
    return _halos(_gather(_edges(x, h), ctx.group), ctx.bounds, ctx.rank, h)


def _out_proj(mixer: BiMambaMixer, out: torch.Tensor) -> torch.Tensor:
    w_out = mixer.out_proj.weight * 0.5 if mixer.divide_out else mixer.out_proj.weight
    out = project(w_out, out).transpose(1, 2)
    return out if mixer.out_proj.bias is None else out + mixer.out_proj.bias


def _mixer_autograd(mixer: BiMambaMixer, hidden: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """The same scheme as ``_mixer``, composed of differentiable ops, its backward left to autograd (which keeps
    every intermediate: the scan's inputs of both passes). The reference the fused ``_MixerScans`` is checked
    against, and in the tests the memory it saves."""
    x, z = _in_proj(mixer, hidden)
    before, after = _conv_halos(mixer, x, ctx)
    pieces, pairs = [], []
    for reverse, halo in ((False, before), (True, after)):
        w = _direction_weights(mixer, reverse)
        # the halo's tokens run through the (token-wise) projections too, and are dropped
        x_ext, chunk = ((torch.cat((x, halo), -1), slice(0, x.shape[-1])) if reverse else
                        (torch.cat((halo, x), -1), slice(halo.shape[-1], None)))
        u, delta, B, C = (t[..., chunk].contiguous()
                          for t in branch_inputs(x_ext, *w[:4], mixer.d_state, ctx.backend, reverse))
        A, D, bias = _scan_params(w, x)
        _, S = selective_scan_with_state(u, delta, A, B, C, None, None, bias, True, reverse, backend=ctx.backend)
        pieces.append((u, delta, B, C, A, D, bias))
        pairs += [decay_product(delta, A, bias, True), S]
    states = _start_states(_gather(torch.stack(pairs), ctx.group), ctx.rank)
    out = 0
    for reverse, (u, delta, B, C, A, D, bias), h0 in zip((False, True), pieces, states):
        y, _ = selective_scan_with_state(u, delta, A, B, C, D, z, bias, True, reverse, h0, backend=ctx.backend)
        out = out + y
    return _out_proj(mixer, out.to(x.dtype))


_MIXER = _mixer  # tests swap in _mixer_autograd


def _block_step(model: VisionMamba, i: int, stream: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """Block i on this rank's chunk of the residual stream: the stream after it (VisionMamba's loop, the add at the
    block's end instead of the next one's start: the same arithmetic and random draws)."""
    layer = model.layers[i]
    residual = at_least_fp32(stream)
    hidden = _MIXER(layer.mixer, layer.norm(residual), ctx)
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
    problem = split_error(model, dist.get_world_size(group))
    if problem:
        raise ValueError(f"cannot split the model's tokens: {problem}")

    def forward(module: VisionMamba, images: torch.Tensor) -> torch.Tensor:
        return sequence_parallel_forward(module, images, group, backend=backend)

    model.split_sequence(forward)
    return model

