"""The selective scan split along the sequence: what a chunk of steps does to the state, and how chunks combine.

Groundwork for splitting a long token sequence over ranks (issue 38): each rank scans one chunk, which must start
from the state that the chunks before it leave (in the flipped direction, Vim's backward mixer: the chunks after it).

For each (batch, channel, state) the recurrence (``csrc/README.md``) is linear in the state:

    h_t = a_t h_{t-1} + b_t,    a_t = exp(delta_t A),    b_t = delta_t B_t u_t

so a chunk maps the state it starts from, h_in, to  P h_in + S,  with P = the product of its a_t
(= exp(A * sum of its delta_t)) and S = its final state started from zero: the chunk's *pair* (P, S). Running
chunk 1 then chunk 2 is a chunk with the pair  combine((P1, S1), (P2, S2)) = (P2 P1, P2 S1 + S2),  associative but
not commutative, identity (1, 0). A chunk's initial state is the S of the combine of all chunks before it, in order
(an exclusive prefix); with ``reverse`` (the recurrence run from the last step to the first) of all chunks after it,
from the last one back (a suffix). Within a chunk scanned from zero, starting from h_in instead adds
exp(A * (delta_first + ... + delta_t)) h_in to the state at step t, hence its C-projection (gated by silu(z)) to the
output: ``state_correction``, so a chunk need not be scanned twice.

The scheme LASP-2 uses for linear attention, for one layer and direction: every rank scans its chunk from zero and
forms its pair, one all-gather of the pairs, each rank combines the prefix it needs locally (``initial_states``) and
adds ``state_correction`` to its output. Everything here is plain differentiable PyTorch (a reference, like
``selective_scan_ref``): autograd carries the state's gradient back the other way, from a chunk to those before it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .selective_scan_ref import per_channel, selective_scan_ref

__all__ = ["chunk_pair", "combine", "decay_product", "initial_states", "state_correction"]

Pair = Tuple[torch.Tensor, torch.Tensor]  # (P, S), each (batch, dim, d_state)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in the scan's accumulation dtype: float64 for float64, else float32 (as selective_scan_ref)."""
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _delta(delta, delta_bias=None, delta_softplus=False) -> torch.Tensor:
    """delta' = softplus(delta + delta_bias) (each part optional), in the accumulation dtype."""
    delta = _wide(delta)
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[:, None]
    return F.softplus(delta) if delta_softplus else delta


def decay_product(delta, A, delta_bias=None, delta_softplus=False) -> torch.Tensor:
    """P (batch, dim, d_state): the product of the chunk's decays exp(delta'_t A), computed as exp(A * sum_t delta'_t).

    delta (batch, dim, L) is the chunk's; A (dim, d_state). It is the same in both directions."""
    d = _delta(delta, delta_bias, delta_softplus)
    return torch.exp(d.sum(-1).unsqueeze(-1) * A.to(d.dtype))


def chunk_pair(u, delta, A, B, delta_bias=None, delta_softplus=False, *, reverse=False) -> Pair:
    """The chunk's pair (P, S) from its u, delta (batch, dim, L) and B (any of selective_scan_ref's forms): S is its
    final state (after its last step; with ``reverse``, after its first) scanned from zero. C, D and z do not reach
    the state; B stands in for C below only because the reference wants one."""
    _, S = selective_scan_ref(u, delta, A, B, B, None, None, delta_bias, delta_softplus, True, reverse=reverse)
    return decay_product(delta, A, delta_bias, delta_softplus), S


def combine(first: Pair, second: Pair) -> Pair:
    """The pair of running chunk `first` and then chunk `second`: h -> P2 (P1 h + S1) + S2."""
    (P1, S1), (P2, S2) = first, second
    return P2 * P1, P2 * S1 + S2


def initial_states(pairs: Sequence[Pair], h0: Optional[torch.Tensor] = None, *, reverse: bool = False):
    """Each chunk's initial state (a list in sequence order) from the chunks' pairs (in sequence order): the S of the
    combine of the chunks before it, or with ``reverse`` of the chunks after it, starting from h0 (zero if None),
    the state before the first chunk (with ``reverse``: before the last one, which then runs first)."""
    order = range(len(pairs) - 1, -1, -1) if reverse else range(len(pairs))
    P, S = pairs[0]
    # everything before the first chunk to run, as a pair: whatever state it receives (zero), it hands on h0
    before = (torch.ones_like(P), torch.zeros_like(S) if h0 is None else h0.to(S.dtype))
    states = [None] * len(pairs)
    for k in order:
        states[k] = before[1]
        before = combine(before, pairs[k])
    return states


def state_correction(h_in, delta, A, C, z=None, delta_bias=None, delta_softplus=False, *, reverse=False):
    """What starting the chunk from h_in (batch, dim, d_state) instead of zero adds to its output (batch, dim, L):

        sum_n exp(A[d, n] * (delta'_first + ... + delta'_t)) h_in[b, d, n] C[b, n, t]   (times silu(z[b, d, t]))

    where the sum of delta' runs from the chunk's first step to t in scan order (with ``reverse``: from its last
    time step down to t). C in any of selective_scan_ref's forms. Returned in float32 (float64 for float64 input):
    add it to the output of the scan from zero before any rounding to a lower precision."""
    d = _delta(delta, delta_bias, delta_softplus)
    reach = d.flip(-1).cumsum(-1).flip(-1) if reverse else d.cumsum(-1)
    decay = torch.exp(reach.unsqueeze(-1) * A.to(d.dtype)[None, :, None, :])  # (batch, dim, L, d_state)
    Ct = per_channel(C.to(d.dtype), A.shape[0]).transpose(-1, -2)  # (batch or 1, dim or 1, L or 1, d_state)
    y = (decay * h_in.to(d.dtype).unsqueeze(2) * Ct).sum(-1)
    return y * F.silu(_wide(z)) if z is not None else y
