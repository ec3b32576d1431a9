"""The scan's performance model (vim_ds/cli/bench/scan_model.py) against independent counts: its bytes against the
sizes of the real tensors a forward and a backward take and give (inputs from `bench scan`'s scan_inputs, outputs
and gradients from the reference), its exp and FMA counts against the operations that a forward and a backward
written step by step in PyTorch execute (counted by a dispatch mode), after checking that those implementations
give the reference's output and autograd's gradients."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vim_ds.cli.bench import scan_model as m
from vim_ds.cli.bench.scan import scan_inputs
from vim_ds.ops.backends import RefBackend
from vim_ds.ops.selective_scan_ref import selective_scan_ref

aten = torch.ops.aten
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_are_the_sizes_of_the_tensors_read_and_written(dtype):
    shape = (2, 6, 9, 4)
    x = scan_inputs(*shape, dtype, torch.device("cpu"))
    args = [x[k] for k in NAMES]
    ref = RefBackend()
    out, _, _ = ref.fwd(*args, True)
    dout = torch.randn_like(out)
    grads = ref.bwd(*args, dout, None, True)
    assert [g.dtype for g in grads] == [a.dtype for a in args]  # as the kernels return them
    name = str(dtype).replace("torch.", "")
    assert m.forward_cost(*shape, name).bytes == nbytes(args) + nbytes([out])
    assert m.backward_cost(*shape, name).bytes == nbytes(args) + nbytes([dout]) + nbytes(grads)
    # Negative controls: the count depends on the dtype and on every tensor (z dropped changes it).
    other = "bfloat16" if name == "float32" else "float32"
    assert m.forward_cost(*shape, other).bytes != nbytes(args) + nbytes([out])
    assert m.forward_cost(*shape, name).bytes != nbytes(args[:6] + args[7:]) + nbytes([out])


# ------------------------------------------------------------------------------------------- operation counts

SFU = {aten.exp: 1, aten.log1p: 1, aten.reciprocal: 1, aten.sigmoid: 2}
PIPE = {aten.mul: 1, aten.add: 1, aten.sub: 1, aten.rsub: 1, aten.addcmul: 1, aten.sigmoid: 1}
FREE = {aten.view, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.expand, aten.select, aten.slice,
        aten.stack, aten.cat, aten.transpose, aten.permute, aten.t, aten.clone, aten.copy_, aten.zeros,
        aten.zeros_like, aten.empty, aten.new_zeros, aten.new_empty, aten.detach, aten.alias, aten.as_strided,
        aten._to_copy, aten.reshape, aten.fill_, aten.zero_, aten.lift_fresh, aten.empty_like, aten.unbind,
        aten.split, aten.flip, aten.index_put_, aten.slice_scatter, aten.select_scatter}


class OpCount(TorchDispatchMode):
    """Counts special-function results (exp, log1p, reciprocal; sigmoid = exp + reciprocal + one add) and
    FMA-pipe operations (mul, add, sub, addcmul: one per element; bmm: one FMA per product term; sum: one add
    per element it folds away). Any other computing op fails the test: nothing escapes the count."""

    def __init__(self):
        super().__init__()
        self.sfu = self.fma = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket
        n = out.numel() if isinstance(out, torch.Tensor) else 0
        if op in SFU or op in PIPE:
            self.sfu += SFU.get(op, 0) * n
            self.fma += PIPE.get(op, 0) * n
        elif op in (aten.bmm, aten.mm):
            self.fma += n * args[0].shape[-1]
        elif op == aten.sum:
            self.fma += args[0].numel() - n
        elif op not in FREE:
            raise AssertionError(f"uncounted operation {func}")
        return out


def forward_steps(u, delta, A, B, C, D, z, delta_bias):
    """The forward with the model's operations, per step over (b, d, n)."""
    dl = torch.log1p(torch.exp(delta + delta_bias[:, None]))
    dlu = dl * u
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        a = torch.exp(dl[:, :, t, None] * A)
        h = torch.addcmul(dlu[:, :, t, None] * B[:, None, :, t], a, h)
        ys.append(torch.bmm(h, C[:, :, t, None])[..., 0])
    y = torch.addcmul(torch.stack(ys, -1), D[:, None], u)
    return y * (z * torch.sigmoid(z))


def backward_steps(u, delta, A, B, C, D, z, delta_bias, dout):
    """The backward with the model's operations: recompute the states (and y, for dz), then the adjoint recurrence
    dh_t = C_t dy_t + a_{t+1} dh_{t+1} from the last step to the first."""
    batch, dim, L = u.shape
    dl0 = delta + delta_bias[:, None]
    e = torch.exp(dl0)
    dl = torch.log1p(e)
    dsp = e * torch.reciprocal(e + 1)
    dlu = dl * u
    sz = torch.sigmoid(z)
    silu = z * sz
    dy = dout * silu
    h = u.new_zeros(batch, dim, A.shape[1])
    hs, avals, ys = [h], [], []
    for t in range(L):
        a = torch.exp(dl[:, :, t, None] * A)
        h = torch.addcmul(dlu[:, :, t, None] * B[:, None, :, t], a, h)
        hs.append(h)
        avals.append(a)
        ys.append(torch.bmm(h, C[:, :, t, None])[..., 0])
    y = torch.addcmul(torch.stack(ys, -1), D[:, None], u)
    avals.append(torch.zeros_like(h))  # a_L: no step after the last
    dh = torch.zeros_like(h)
    dB, dC, sBs, sAs = torch.zeros_like(B), torch.zeros_like(C), [None] * L, [None] * L
    dA = torch.zeros_like(h)
    for t in range(L - 1, -1, -1):
        dh = torch.addcmul(C[:, None, :, t] * dy[:, :, t, None], avals[t + 1], dh)
        dC[:, :, t] = torch.bmm(hs[t + 1].transpose(1, 2), dy[:, :, t, None])[..., 0]
        dB[:, :, t] = torch.bmm(dh.transpose(1, 2), dlu[:, :, t, None])[..., 0]
        sBs[t] = torch.bmm(dh, B[:, :, t, None])[..., 0]
        gh = (dh * avals[t]) * hs[t]
        dA = torch.addcmul(dA, gh, dl[:, :, t, None])
        sAs[t] = torch.bmm(gh.transpose(0, 1), A[:, :, None])[..., 0].transpose(0, 1)
    sB, sA = torch.stack(sBs, -1), torch.stack(sAs, -1)
    du = torch.addcmul(D[:, None] * dy, sB, dl)
    ddelta = torch.addcmul(sA, sB, u) * dsp
    dz = (dout * y) * (sz * (1 + z * (1 - sz)))
    dD = (dy * u).sum((0, 2))
    return du, ddelta, dA.sum(0), dB, dC, dD, dz, ddelta.sum((0, 2))


def _inputs(batch, dim, L, N, seed=0):
    torch.manual_seed(seed)
    return [v.double() for v in scan_inputs(batch, dim, L, N, torch.float64, torch.device("cpu")).values()]


def test_the_step_implementations_compute_the_scan_and_its_gradients():
    args = _inputs(2, 3, 7, 5)
    out = forward_steps(*args)
    ref = selective_scan_ref(*args, delta_softplus=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    leaves = [a.clone().requires_grad_(True) for a in args]
    dout = torch.randn_like(out)
    expected = torch.autograd.grad(selective_scan_ref(*leaves, delta_softplus=True), leaves, dout)
    for name, got, want in zip(NAMES, backward_steps(*args, dout), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
    # Negative control: the state recurrence one step shifted (C read at t+1) is caught.
    args[4] = torch.roll(args[4], 1, -1)
    assert not torch.allclose(forward_steps(*args), ref)


def _count(fn, batch, dim, L, N):
    args = _inputs(batch, dim, L, N)
    if fn is backward_steps:
        args.append(torch.randn(batch, dim, L, dtype=torch.float64))
    with OpCount() as c:
        fn(*args)
    return c.sfu, c.fma


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_exp_and_fma_counts_are_those_of_a_correct_implementation(kind):
    """Per (b, d, t, n) from the mixed difference of counts over two N and two L (terms that do not grow with
    both cancel); per (b, d, t) from the difference over L at fixed N."""
    fn = forward_steps if kind == "forward" else backward_steps
    b, d, (L1, L2), (N1, N2) = 2, 3, (4, 7), (3, 5)
    T = {(n, length): _count(fn, b, d, length, n) for n in (N1, N2) for length in (L1, L2)}
    per_elem = [((T[N2, L2][i] - T[N2, L1][i]) - (T[N1, L2][i] - T[N1, L1][i])) / (b * d * (L2 - L1) * (N2 - N1))
                for i in (0, 1)]
    per_row = [(T[N1, L2][i] - T[N1, L1][i]) / (b * d * (L2 - L1)) - per_elem[i] * N1 for i in (0, 1)]
    if kind == "forward":
        model = [m.FWD_EXP_PER_ELEM, m.FWD_FMA_PER_ELEM], [m.FWD_EXP_PER_ROW, m.FWD_FMA_PER_ROW]
    else:
        model = [m.BWD_EXP_PER_ELEM, m.BWD_FMA_PER_ELEM], [m.BWD_EXP_PER_ROW, m.BWD_FMA_PER_ROW]
    assert per_elem == model[0] and per_row == model[1]
    cost = (m.forward_cost if kind == "forward" else m.backward_cost)(b, d, L2, N2)
    bdl = b * d * L2
    assert cost.exp == model[0][0] * bdl * N2 + model[1][0] * bdl
    assert cost.fma == model[0][1] * bdl * N2 + model[1][1] * bdl


def test_the_counter_misses_nothing():
    """Negative control of the counter: an op it has no rule for fails the count instead of counting 0."""
    with pytest.raises(AssertionError, match="uncounted operation"):
        with OpCount():
            torch.tanh(torch.ones(3))


def test_bounds_take_the_busiest_unit_and_predictions_cover_the_bench():
    h100 = m.GPUS[0]
    cost = m.KernelCost(bytes=int(3.35e9), exp=0, fma=0)  # 1 ms of HBM traffic on an H100 SXM
    assert cost.bound(h100)["bound_by"] == "memory" and cost.bound(h100)["seconds"] == pytest.approx(1e-3)
    exp_bound = m.KernelCost(bytes=1, exp=int(67e12 / 16 * 1e-3), fma=1).bound(h100)
    assert exp_bound["bound_by"] == "exp" and exp_bound["seconds"] == pytest.approx(1e-3)
    rows = m.predictions()
    assert len(rows) == len(m.BENCH_SHAPES) * 2
    for r in rows:
        for g in m.GPUS:
            b = r["bounds"][g.name]
            assert 0 < b["fwd_ms"] < b["fwd_bwd_ms"]
            assert b["fwd_bwd_ms"] == pytest.approx(b["fwd_ms"] + b["bwd_ms"])
    assert m.gpu_for_device("NVIDIA H100 80GB HBM3") is h100
    assert m.gpu_for_device("NVIDIA H100 PCIe") is None and m.gpu_for_device("AMD Instinct MI210") is None
    assert m.gpu_for_device("NVIDIA H200").name == "H200 SXM"
    assert m.gpu_for_device("AMD Instinct MI300X").name == "MI300X"
    assert m.compare(2.0, 0.5) == 4.0 and m.compare(None, 0.5) is None


def test_the_kernel_comment_quotes_the_models_bounds():
    """The "Performance model" paragraph of csrc/selective_scan_kernel.cuh quotes the bounds; they must stay the
    model's (a change to the model or the rates without the comment fails here)."""
    import os
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                        "selective_scan_kernel.cuh")
    text = open(path).read()
    assert "// Performance model" in text
    row = re.compile(r"^//\s+(?:B=(\d+)\s+D=(\d+)\s+L=(\d+))?\s+(fp32|bf16)\s+"
                     + r"\s+".join([r"([\d.]+) / ([\d.]+)"] * 3))
    quoted, shape = [], None
    for line in text.splitlines():
        hit = row.match(line)
        if hit:
            shape = tuple(int(g) for g in hit.groups()[:3]) + (16,) if hit.group(1) else shape
            dtype = {"fp32": "float32", "bf16": "bfloat16"}[hit.group(4)]
            quoted.append((shape, dtype, [float(x) for x in hit.groups()[4:]]))
    assert len(quoted) == 2 * len(m.BENCH_SHAPES)
    for shape, dtype, values in quoted:
        b = m.predict(*shape, dtype)["bounds"]
        want = [v for g in ("H100 SXM", "MI250X (one GCD)", "MI300X") for v in (b[g]["fwd_ms"], b[g]["fwd_bwd_ms"])]
        assert values == [round(v, 3) for v in want], (shape, dtype)
