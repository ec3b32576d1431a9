"""The selective scan from an initial state with its last state and their gradients (issue 38's kernel part):
``selective_scan_with_state`` on the CPU kernel (every ISA variant), the ``ref`` backend and (``-m gpu``, skipped
without one) the GPU kernel against ``selective_scan_ref`` with ``h0``. The GPU kernel's device code also runs
here without a GPU, in the CPU emulator (tests/test_kernel_emu_lengths.py, tools/kernel_emu).

The loss depends on both outputs, sum(out * dout) + sum(last * dlast), so every gradient carries both paths:
the outputs' and the last state's (``dlast``) back to the inputs and to ``h0``.
"""
import pytest
import torch

from vim_ds.ops.scan_state import selective_scan_state_fwd, selective_scan_with_state
from vim_ds.ops.selective_scan import scan_with_backend
from vim_ds.ops.selective_scan_ref import selective_scan_ref

NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0"]
RESULTS = ["out", "last"] + [f"d{n}" for n in NAMES]
FLAGS = {"D z bias": (True, True, True), "plain": (False, False, False)}
LENGTHS = [1, 7, 301]


def make(dtype, L, flags=(True, True, True), batch=2, dim=4, N=16):
    """Inputs (rounded to dtype; A, D, delta_bias, h0 in float32 / float64), and dout, dlast; from torch's RNG."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, dtype=torch.float64)  # noqa: E731
    u, z, delta = r(batch, dim, L), r(batch, dim, L), 0.5 * r(batch, dim, L)
    B, C = r(batch, N, L), r(batch, N, L)
    A = -(torch.rand(dim, N, dtype=torch.float64) * 2 + 0.1)
    D, bias, h0 = r(dim), 0.3 * r(dim), r(batch, dim, N)
    has_D, has_z, has_bias = flags
    args = [u.to(dtype), delta.to(dtype), A.to(wide), B.to(dtype), C.to(dtype), D.to(wide) if has_D else None,
            z.to(dtype) if has_z else None, bias.to(wide) if has_bias else None, h0.to(wide)]
    return args, r(batch, dim, L).to(dtype), r(batch, dim, N).to(wide)


def results(scan, args, dout, dlast):
    """[out, last, du, ..., dh0] of scan(*leaves) -> (out, last) with loss sum(out dout) + sum(last dlast); dlast
    None: the loss reads out only."""
    leaves = [None if a is None else a.clone().requires_grad_(True) for a in args]
    out, last = scan(*leaves)
    loss = (out.double() * dout.double()).sum()
    if dlast is not None:
        loss = loss + (last.double() * dlast.double()).sum()
    present = [a for a in leaves if a is not None]
    grads = iter(torch.autograd.grad(loss, present, allow_unused=True))
    return [out.detach(), last.detach()] + [None if a is None else next(grads) for a in leaves]


def kernel(backend, reverse, use_h0=True):
    def scan(u, delta, A, B, C, D, z, bias, h0):
        return selective_scan_with_state(u, delta, A, B, C, D, z, bias, True, reverse, h0 if use_h0 else None,
                                         backend=backend)
    return scan


def reference(reverse):
    def scan(u, delta, A, B, C, D, z, bias, h0):
        def wide(t):
            return None if t is None else t.double()
        return selective_scan_ref(wide(u), wide(delta), wide(A), wide(B), wide(C), wide(D), wide(z), wide(bias),
                                  True, True, reverse=reverse, h0=wide(h0))
    return scan


def worst(got, want):
    """The largest error of any result, relative to that result's largest reference value, and its name."""
    errs = {name: ((g.double() - w).abs().max() / (w.abs().max() + 1e-300)).item()
            for name, g, w in zip(RESULTS, got, want) if g is not None}
    name = max(errs, key=errs.get)
    return errs[name], name




# Measured 2026-11-27 over 5 seeds x 3 ISA variants x these cases: at most 1.6e-15 (dA, avx2, reverse, L = 301).
# The controls below missed by at least 3.4e-2 (h0 ignored), 0.28 (dlast dropped) and 0.72 (the wrong end's dh0).
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_cpu_float64_matches_reference(reverse, flags, L, cpu_isa, seed):
    args, dout, dlast = make(torch.float64, L, flags)
    got = results(kernel("cpu", reverse), args, dout, dlast)
    want = results(reference(reverse), args, dout, dlast)
    err, name = worst(got, want)
    assert err <= 1e-10, f"{name}: {err:.2e}"


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_ref_backend_matches_reference(reverse, seed):
    args, dout, dlast = make(torch.float64, 23)
    err, name = worst(results(kernel("ref", reverse), args, dout, dlast),
                      results(reference(reverse), args, dout, dlast))
    assert err <= 1e-12, f"{name}: {err:.2e}"


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_controls_fail(reverse, cpu_isa, seed):
    """What the comparison above must catch: h0 ignored; the last state's gradient dropped; h0 taken (and its
    gradient given) at the wrong end of the sequence."""
    args, dout, dlast = make(torch.float64, 37)
    want = results(reference(reverse), args, dout, dlast)
    ignored = results(kernel("cpu", reverse, use_h0=False), args, dout, dlast)
    assert worst(ignored[:2], want[:2])[0] > 1e-3  # out and last state
    dropped = results(kernel("cpu", reverse), args, dout, None)
    assert worst(dropped[2:], want[2:])[0] > 1e-3  # the gradients
    # the wrong end: the scan of the other direction, whose h0 enters (and whose dh0 is read) at the other end
    wrong = results(kernel("cpu", not reverse), args, dout, dlast)
    assert (wrong[-1] - want[-1]).abs().max() > 1e-3 * want[-1].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_without_h0_is_the_plain_scan_bitwise(dtype, reverse, cpu_isa, seed):
    """Left out, h0 changes nothing: out, the last state and every gradient are bitwise the plain op's."""
    args, dout, _ = make(dtype, 37)
    args = args[:8] + [None]
    got = results(kernel("cpu", reverse), args, dout, None)

    def plain(u, delta, A, B, C, D, z, bias, h0):
        return scan_with_backend("cpu", u, delta, A, B, C, D, z, bias, True, True, reverse=reverse)
    want = results(plain, args, dout, None)
    for name, g, w in zip(RESULTS, got, want):
        assert (g is None) == (w is None), name
        assert g is None or torch.equal(g, w), name


# Float32 and bfloat16 against the float64 reference on the same (rounded) inputs: the error beyond rounding the
# float64 result to the result's dtype, relative to the result's largest value. Measured on the CPU kernel at
# (2, 8, 197, 16) with h0 and dlast, 20 seeds x 3 ISA variants x 2 directions: bf16 results (out, du, ddelta, dB,
# dC, dz) <= 2.2e-7; float32 results (all of float32 input's; bf16 input's last state, dh0, dA, dD, ddelta_bias)
# <= 3.2e-6 (dA, a float32 sum over batch x length), dh0 <= 1.2e-6, the last state <= 6.8e-7. Bounds ~5x those;
# ignoring h0 or dlast errs by > 1e-3 (test_controls_fail).
EXCESS = {torch.bfloat16: 1e-6, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_cpu_low_precision_against_float64(dtype, reverse, cpu_isa, seed):
    args, dout, dlast = make(dtype, 197, dim=8)
    got = results(kernel("cpu", reverse), args, dout, dlast)
    want = results(reference(reverse), [None if a is None else a.double() for a in args], dout.double(),
                   dlast.double())
    for name, g, w in zip(RESULTS, got, want):
        floor = (w.to(g.dtype).double() - w).abs()
        err = (((g.double() - w).abs() - floor).max() / w.abs().max()).item()
        assert err <= EXCESS[g.dtype], f"{name} ({g.dtype}): {err:.2e}"


# -- h0_grad: the initial state's gradient alone (what the sequence split asks for before its backward) ----------

def h0_grad(backend, args, dout, reverse):
    from vim_ds.ops.library import resolve

    u, delta, A, B, C, D, z, bias, h0 = args
    return resolve(backend, u.device).h0_grad(u, delta, A, B, C, z, bias, dout, u.new_empty(0), True, reverse, h0)


# Measured 2026-11-28 over 5 seeds x 3 ISA variants x these cases: bitwise the full backward's dh0 (the same
# operations in the same order), and within 5.8e-16 of the reference's autograd. Control: the other direction's
# pass errs by at least 0.28 (L > 1).
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_cpu_h0_grad_float64(reverse, flags, L, cpu_isa, seed):
    args, dout, _ = make(torch.float64, L, flags)
    want = results(reference(reverse), args, dout, None)[-1]  # dh0 of sum(out dout), by autograd
    got = h0_grad("cpu", args, dout, reverse)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12
    # the same bits as the full backward's dh0 without dlast
    assert torch.equal(got, results(kernel("cpu", reverse), args, dout, None)[-1])
    # control: the other direction's pass (h0 at the other end) must miss (one step has no other end)
    if L > 1:
        wrong = h0_grad("cpu", args, dout, not reverse)
        assert ((wrong - want).abs().max() / want.abs().max()).item() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_cpu_h0_grad_low_precision(dtype, reverse, cpu_isa, seed):
    args, dout, _ = make(dtype, 197, dim=8)
    got = h0_grad("cpu", args, dout, reverse)
    assert torch.equal(got, results(kernel("cpu", reverse), args, dout, None)[-1])
    want = results(reference(reverse), [None if a is None else a.double() for a in args], dout.double(), None)[-1]
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= EXCESS[torch.float32]


def test_ref_h0_grad(seed):
    args, dout, _ = make(torch.float64, 23)
    want = results(reference(True), args, dout, None)[-1]
    assert torch.allclose(h0_grad("ref", args, dout, True), want, rtol=0, atol=1e-12 * want.abs().max().item())


def test_h0_shape_is_checked():
    args, _, _ = make(torch.float64, 5)
    with pytest.raises(ValueError, match="h0 must be of shape"):
        selective_scan_with_state(*args[:8], h0=args[8][:, :, :3], backend="cpu")


@pytest.mark.parametrize("backend", ["cpu", "ref", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(backend):
    """The registered op's fake implementation, autograd registration and schema (torch.library.opcheck)."""
    torch.manual_seed(0)
    args, _, _ = make(torch.float64, 5, batch=1, dim=2, N=3)
    if backend == "cuda":
        args = on_gpu(args)
    torch.library.opcheck(selective_scan_state_fwd, (*args, True, True, backend))


# -- the GPU kernel ----------------------------------------------------------------------------------------------

def on_gpu(tensors):
    return [None if t is None else t.cuda() for t in tensors]


# At batch 2 x dim 4 the GPU kernel splits the sequence into segments of 2 chunks (fp64 at d_state 16: chunks of
# 16 steps): 10 at L = 301, 129 at 4100 (the emulator's launcher says the same), so h0 enters segment 0's two
# passes and dlast the last segment's, across the combine.
@pytest.mark.gpu
@pytest.mark.parametrize("L", LENGTHS + [4100])
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_gpu_float64_matches_reference(reverse, flags, L, seed):
    args, dout, dlast = make(torch.float64, L, flags)
    args, (dout, dlast) = on_gpu(args), on_gpu((dout, dlast))
    err, name = worst(results(kernel("cuda", reverse), args, dout, dlast),
                      results(reference(reverse), args, dout, dlast))
    assert err <= 1e-10, f"{name}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_gpu_controls_fail(reverse, seed):
    """h0 ignored and the last state's gradient dropped, on the GPU kernel, over several segments."""
    args, dout, dlast = make(torch.float64, 301)
    args, (dout, dlast) = on_gpu(args), on_gpu((dout, dlast))
    want = results(reference(reverse), args, dout, dlast)
    assert worst(results(kernel("cuda", reverse, use_h0=False), args, dout, dlast)[:2], want[:2])[0] > 1e-3
    assert worst(results(kernel("cuda", reverse), args, dout, None)[2:], want[2:])[0] > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_gpu_without_h0_is_the_plain_scan_bitwise(dtype, reverse, seed):
    args, dout, _ = make(dtype, 301)
    args, dout = on_gpu(args[:8]) + [None], dout.cuda()
    got = results(kernel("cuda", reverse), args, dout, None)

    def plain(u, delta, A, B, C, D, z, bias, h0):
        return scan_with_backend("cuda", u, delta, A, B, C, D, z, bias, True, True, reverse=reverse)
    for name, g, w in zip(RESULTS, got, results(plain, args, dout, None)):
        assert (g is None) == (w is None), name
        assert g is None or torch.equal(g, w), name


@pytest.mark.gpu
@pytest.mark.parametrize("L", [197, 4100])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_gpu_float32_against_float64(reverse, L, seed):
    """Float32 on the GPU kernel within the plain GPU scan's float32 bound (tests/test_selective_scan.py)."""
    args, dout, dlast = make(torch.float32, L, dim=8)
    got = results(kernel("cuda", reverse), on_gpu(args), dout.cuda(), dlast.cuda())
    wide = on_gpu([None if a is None else a.double() for a in args])
    want = results(reference(reverse), wide, dout.double().cuda(), dlast.double().cuda())
    err, name = worst(got, want)
    assert err <= 2e-4, f"{name}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("L", [7, 301, 4100])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_gpu_h0_grad(reverse, L, seed):
    """The GPU kernel's h0_grad (the backward's pass 0 over one segment) against the reference's autograd."""
    args, dout, _ = make(torch.float64, L)
    want = results(reference(reverse), args, dout, None)[-1]
    got = h0_grad("cuda", on_gpu(args), dout.cuda(), reverse).cpu()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-12
    if L > 1:
        wrong = h0_grad("cuda", on_gpu(args), dout.cuda(), not reverse).cpu()
        assert ((wrong - want).abs().max() / want.abs().max()).item() > 1e-2
