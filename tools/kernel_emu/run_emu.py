"""Run the GPU selective-scan kernels of csrc/ on the CPU (libscan_emu.so, see build.sh) and compare them with
autograd on the pure-PyTorch reference.

What the emulation checks beyond the maths: every output element is written (outputs start as NaN); no shared
memory is read before it is written in the same block (it starts as NaN); no buffer is accessed out of bounds
(each sits next to a guard page: SIGSEGV); every thread of a block reaches the same __syncthreads and shuffles
(else the emulator aborts with "divergent synchronisation"); and the results do not depend on the order in which
threads and blocks run, and are the same bits run after run (no float atomics: every sum has a fixed order).

usage: run_emu.py [--quick | --full | [--lengths] [--layouts] | --races] [--warp 32|64]
  --lengths: the Vim lengths L = 1, 7, 65, 197, 785, 1025, 4097, 6085 (65: just past the first chunk boundary),
             forward and all gradients, reverse off and on (batch 1, 5 channels: one block of channels, the
             sequence split into segments); then 20 channels (several blocks of channels, so dB/dC partials)
             at L <= 1025; half of them from an initial state h0 with a gradient on the last state (dh0
             checked); then the bitwise determinism check (same inputs twice, other block/thread order).
  --layouts: the launcher's layout capped as `vim-ds bench scan --layouts` caps it on a GPU (chunk length, channel
             tiles a backward block walks, blocks aimed at, so segments along the sequence), each layout checked to
             be the one asked for, forward and all gradients against the reference, and the same bits under
             another thread/block order.
  --races:   each kernel instance and path Vim's shapes reach (races()), on the counting build
             (libscan_emu_count.so, libscan_emu_count64.so for --warp 64), which also logs every access a block
             makes to shared memory and to the launch's buffers: every pair of accesses to the same bytes by two
             threads that a GPU does not order, one a write, is a failure (between warps or blocks; within a warp,
             between the same two switch points or with only a shuffle between), but for a pair within a warp
             whose line in the kernel source says "benign race within a warp" and why (emu_race.cpp; the
             emulator's own scheduling orders more than a GPU does, so these are not seen in the results).
  --warp 64: the wave64 build (libscan_emu64.so: the device code through its HIP branch, 64-lane wavefronts).
(library: $SCAN_EMU_LIB, default ./build/libscan_emu.so, or libscan_emu64.so next to it for --warp 64)"""
import ctypes
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from vim_ds.ops.selective_scan_ref import selective_scan_ref  # noqa: E402

WARP = int(sys.argv[sys.argv.index("--warp") + 1]) if "--warp" in sys.argv else 32
RACES = "--races" in sys.argv
_lib32 = os.environ.get("SCAN_EMU_LIB", os.path.join(HERE, "build", "libscan_emu.so"))
LIB_PATH = os.path.join(os.path.dirname(_lib32), ("libscan_emu_count" if RACES else "libscan_emu")
                        + ("" if WARP == 32 else "64") + ".so")
lib = ctypes.CDLL(LIB_PATH)
lib.emu_set_reverse.argtypes = [ctypes.c_int]
lib.emu_warp_size.restype = ctypes.c_int
lib.emu_run.restype = ctypes.c_char_p
lib.emu_run.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_longlong] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 23
lib.emu_num_checkpoints.restype = ctypes.c_longlong
lib.emu_num_checkpoints.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int]
lib.emu_chunk_length.restype = ctypes.c_longlong
lib.emu_chunk_length.argtypes = [ctypes.c_longlong, ctypes.c_int]
lib.emu_num_segments.restype = ctypes.c_longlong
lib.emu_num_segments.argtypes = [ctypes.c_longlong] * 4 + [ctypes.c_int]
lib.emu_config.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_int]
lib.emu_set_tuning.restype = ctypes.c_char_p
lib.emu_set_tuning.argtypes = [ctypes.c_longlong] * 4
lib.emu_layout.argtypes = [ctypes.c_longlong] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_longlong)]

lib.emu_set_accumulate.argtypes = [ctypes.c_int]
lib.emu_conv.restype = ctypes.c_char_p
lib.emu_conv.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_longlong] * 4 \
    + [ctypes.c_int, ctypes.c_int, ctypes.c_longlong] + [ctypes.c_void_p] * 8

DT = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}

# The race check (--races): the pairs of racing accesses found, by (kind, kernel-source lines), those allowed by a
# mark in the kernel source, and what was checked.
BENIGN = "benign race within a warp"
RACE_LOG = {"launches": 0, "accesses": 0, "allowed": {}, "found": {}, "kernels": set()}


def _source_lines(site):
    """The kernel-source lines (file name, line number, text) of a call site "+0xOFFSET" in the library (a return
    address: the call is the byte before it), inlined frames included (addr2line -i), innermost first: those in the
    build's copies of the csrc/ files (gen/, line for line the sources it was built from)."""
    import subprocess
    call = hex(int(site[1:], 16) - 1)
    res = subprocess.run(["addr2line", "-i", "-e", LIB_PATH, call], capture_output=True, text=True, check=True)
    lines = []
    for frame in res.stdout.split():
        path, _, number = frame.rpartition(":")
        if os.path.basename(os.path.dirname(path)) == "gen" and os.path.isfile(path) and number.isdigit():
            lines.append((os.path.basename(path), int(number), open(path).read().splitlines()[int(number) - 1]))
    return lines


def check_races(what):
    """After a launch on the counting build: note each pair of racing accesses it found in RACE_LOG, the pairs
    within a warp whose source line is marked BENIGN apart from the others."""
    import re
    RACE_LOG["launches"] += 1
    RACE_LOG["accesses"] += lib.emu_race_accesses()
    for i in range(lib.emu_count_launches()):  # the kernel instances that ran
        name = ctypes.create_string_buffer(512)
        lib.emu_count_launch(i, (ctypes.c_longlong * 15)(), name, len(name))
        RACE_LOG["kernels"].add(name.value.decode())
    lib.emu_count_reset()
    for i in range(lib.emu_race_pairs()):
        times, text = ctypes.c_longlong(), ctypes.create_string_buffer(2048)
        kind = lib.emu_race_kind(lib.emu_race_pair(i, ctypes.byref(times), text, len(text))).decode()
        text = text.value.decode()
        # each site's innermost line in the kernel sources (the functions the kernel inlines included)
        frames = [_source_lines(site)[:1] for site in re.findall(r"\+0x[0-9a-f]+", text)]
        frames = [f[0] for f in frames if f]
        where = "; ".join(f"{name}:{number}" for name, number, _ in frames)
        allowed = "within a warp" in kind and any(BENIGN in line for *_, line in frames)
        log = RACE_LOG["allowed" if allowed else "found"]
        first, n = log.get((kind, where), (f"{text} (in {what})", 0))
        log[(kind, where)] = (first, n + times.value)
    lib.emu_race_reset()


if RACES:  # every launch of the kernels through emu_run / emu_conv is checked after it (their callers as they are)
    lib.emu_race_kind.restype = ctypes.c_char_p
    lib.emu_race_accesses.restype = ctypes.c_longlong
    lib.emu_race_pair.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_char_p, ctypes.c_int]
    lib.emu_count_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_char_p, ctypes.c_int]

    def _checked(run, what):
        def call(*args):
            err = run(*args)
            check_races(f"{what} {'backward' if args[0] else 'forward'}, dtype {args[1]}, shape {args[2:6]}")
            return err
        return call

    lib.emu_run = _checked(lib.emu_run, "scan")
    lib.emu_conv = _checked(lib.emu_conv, "conv")


def ptr(t):
    return None if t is None else t.data_ptr()


def emu_fwd(u, delta, A, B, C, D, z, bias, sp, last_state=True, h0=None, add_to=None):
    """-> (out, saved, last_state or None): last_state (batch, dim, N) in A's dtype, the kernel's native one; the
    scan starts from h0 (batch, dim, N) in A's dtype when given; with add_to, out is add_to plus the scan's output
    (ScanArgs::accumulate; add_to is left as it is)."""
    batch, dim, L = u.shape
    N = A.shape[1]
    dt = DT[u.dtype]
    out = torch.empty_like(u) if add_to is None else add_to.clone()
    saved = torch.empty(batch, dim, lib.emu_num_checkpoints(L, N, dt), N, dtype=A.dtype)
    last = torch.empty(batch, dim, N, dtype=A.dtype) if last_state else None
    lib.emu_set_accumulate(int(add_to is not None))
    try:
        err = lib.emu_run(0, dt, batch, dim, L, N, int(sp), ptr(u), ptr(delta), ptr(A), ptr(B), ptr(C), ptr(D),
                          ptr(z), ptr(bias), ptr(out), ptr(saved), *([None] * 9), ptr(last), ptr(h0), None, None)
    finally:
        lib.emu_set_accumulate(0)
    assert err is None, err
    return out, saved, last


def emu_bwd(u, delta, A, B, C, D, z, bias, dout, saved, sp, h0=None, dlast=None):
    """-> the 8 gradients, then dh0 (None without h0); dlast: the last state's gradient (None: zero)."""
    batch, dim, L = u.shape
    N = A.shape[1]
    dt = DT[u.dtype]
    acc = A.dtype
    du, ddelta = torch.empty_like(u), torch.empty_like(u)
    dz = torch.empty_like(u) if z is not None else None
    dA = torch.empty_like(A)
    dB = torch.empty(batch, N, L, dtype=acc)
    dC = torch.empty(batch, N, L, dtype=acc)
    dD = torch.empty_like(D) if D is not None else None
    dbias = torch.empty_like(bias) if bias is not None else None
    dh0 = torch.empty_like(h0) if h0 is not None else None
    err = lib.emu_run(1, dt, batch, dim, L, N, int(sp), ptr(u), ptr(delta), ptr(A), ptr(B), ptr(C), ptr(D), ptr(z),
                      ptr(bias), None, ptr(saved), ptr(dout), ptr(du), ptr(ddelta), ptr(dz), ptr(dA), ptr(dB),
                      ptr(dC), ptr(dD), ptr(dbias), None, ptr(h0), ptr(dlast), ptr(dh0))
    assert err is None, err
    return du, ddelta, dA, dB.to(u.dtype), dC.to(u.dtype), dD, dz, dbias, dh0


def emu_h0_grad(u, delta, A, B, C, z, bias, dout, sp):
    """-> dh0 of the output alone (scan_h0_grad: the backward's pass 0 over one segment)."""
    batch, dim, L = u.shape
    N = A.shape[1]
    dh0 = torch.empty(batch, dim, N, dtype=A.dtype)
    err = lib.emu_run(2, DT[u.dtype], batch, dim, L, N, int(sp), ptr(u), ptr(delta), ptr(A), ptr(B), ptr(C), None,
                      ptr(z), ptr(bias), None, None, ptr(dout), *([None] * 9), None, None, ptr(dh0))
    assert err is None, err
    return dh0


# smallest relative error of the negative controls over the cases that ran them: the state one step before the
# end against the kernel's last_state; with an initial state, the reference scanned from zero against the kernel's
# output, and against the kernel's dh0 the reference's dh0 of the other direction and (where the last state's
# gradient reaches h0 at all) its dh0 without that gradient
CONTROL = {"last_state": float("inf"), "from zero": float("inf"), "dh0 of the other direction": float("inf"),
           "dh0 without dlast": float("inf"), "dh0 alone against dh0 with dlast": float("inf")}
TOL = {torch.float64: 1e-11, torch.float32: 2e-5, torch.float16: 1.5e-2, torch.bfloat16: 3e-2}
NAMES = ["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dh0"]


def case(dtype, batch, dim, L, N, has_D, has_z, has_bias, sp, seed, order=0, guard_front=0, reverse=False,
         last_state=False, state=False):
    """One forward and backward on the emulated kernels against the float64 reference. `state`: the scan starts
    from a random h0 and the last state has a random gradient dlast (the split of a sequence over ranks)."""
    lib.emu_config(order, seed, guard_front)
    lib.emu_set_reverse(int(reverse))
    assert lib.emu_warp_size() == WARP, (lib.emu_warp_size(), WARP)
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u, B, C, z, dout = r(batch, dim, L), r(batch, N, L), r(batch, N, L), r(batch, dim, L), r(batch, dim, L)
    delta = 0.5 * r(batch, dim, L)
    if not sp:
        delta = delta.abs() * 0.5
    delta[0, 0, 0] = 25.0 if sp else delta[0, 0, 0]   # softplus pass-through branch
    A = -(torch.rand(dim, N, generator=g, dtype=torch.float64) * 2 + 0.1)
    D, bias = r(dim), 0.3 * r(dim)
    if not sp:
        bias = bias.abs()  # keep delta + bias > 0, else the state grows without bound over long sequences
    # inputs in the kernel's dtypes; the reference sees exactly the same (rounded) values in float64
    ins = [t.to(dtype) for t in (u, delta, B, C, z, dout)]
    u_, delta_, B_, C_, z_, dout_ = ins
    A_, D_, bias_ = A.to(acc), D.to(acc), bias.to(acc)
    Dk, zk, bk = (D_ if has_D else None), (z_ if has_z else None), (bias_ if has_bias else None)
    h0_ = r(batch, dim, N).to(acc) if state else None
    dlast_ = r(batch, dim, N).to(acc) if state else None
    # every other case without the last state: the kernel must also run (and write nothing there) when not asked
    want_last = seed % 2 == 0 or last_state or state
    out, saved, last = emu_fwd(u_, delta_, A_, B_, C_, Dk, zk, bk, sp, want_last, h0_)
    grads = emu_bwd(u_, delta_, A_, B_, C_, Dk, zk, bk, dout_, saved, sp, h0_, dlast_)

    ref_in = [t.double().clone().requires_grad_() for t in (u_, delta_, A_, B_, C_, D_, z_, bias_)]
    tu, tdl, tA, tB, tC, tD, tz, tb = ref_in
    th0 = h0_.double().clone().requires_grad_() if state else None
    ref_out, ref_last = selective_scan_ref(tu, tdl, tA, tB, tC, tD if has_D else None, tz if has_z else None,
                                           tb if has_bias else None, delta_softplus=sp, return_last_state=True,
                                           reverse=reverse, h0=th0)
    if state:
        # negative controls for dh0: the reference's without the last state's gradient, and the one of the scan in
        # the other direction (h0 entering at the other end of the sequence)
        dh0_no_dlast = torch.autograd.grad(ref_out, th0, dout_.double(), retain_graph=True)[0]
        torch.autograd.backward([ref_out, ref_last], [dout_.double(), dlast_.double()])
        other_in = [t.detach().clone().requires_grad_() for t in (tu, tdl, tA, tB, tC, tD, tz, tb, th0)]
        o_out, o_last = selective_scan_ref(*other_in[:5], other_in[5] if has_D else None,
                                           other_in[6] if has_z else None, other_in[7] if has_bias else None,
                                           delta_softplus=sp, return_last_state=True, reverse=not reverse,
                                           h0=other_in[8])
        dh0_other_end = torch.autograd.grad([o_out, o_last], other_in[8], [dout_.double(), dlast_.double()])[0]
    else:
        ref_out.backward(dout_.double())
    refs = [tu.grad, tdl.grad, tA.grad, tB.grad, tC.grad, tD.grad if has_D else None, tz.grad if has_z else None,
            tb.grad if has_bias else None, th0.grad if state else None]
    tol = TOL[dtype]
    res = {}

    def cmp(name, mine, ref):
        if ref is None:
            assert mine is None, name
            return
        mine = mine.double()
        assert torch.isfinite(mine).all(), f"{name}: non-finite values (unwritten or poisoned)"
        err = ((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        res[name] = err
        assert err < tol, f"{name}: rel err {err:.3g} > {tol}"

    def control(name, mine, wrong):
        e = ((mine.double() - wrong).abs().max() / wrong.abs().max().clamp_min(1e-30)).item()
        assert e > 2 * tol, f"{name}: the negative control passes too (rel err {e:.3g})"
        CONTROL[name] = min(CONTROL[name], e)

    cmp("out", out, ref_out.detach())
    if state:
        with torch.no_grad():
            from_zero = selective_scan_ref(tu, tdl, tA, tB, tC, tD if has_D else None, tz if has_z else None,
                                           tb if has_bias else None, delta_softplus=sp, reverse=reverse)
        if dtype in (torch.float32, torch.float64):  # bf16's and fp16's bounds are coarser than h0's share of out
            control("from zero", out, from_zero)
        if L > 1:  # one step is the same scan in both directions
            control("dh0 of the other direction", grads[8], dh0_other_end)
        # dlast reaches dh0 through every step's decay: only over short chunks of the sequence does it show
        reach = ((th0.grad - dh0_no_dlast).abs().max() / th0.grad.abs().max()).item()
        if reach > 10 * tol:
            control("dh0 without dlast", grads[8], dh0_no_dlast)
        # the initial state's gradient alone (what the sequence split asks for before its backward)
        alone = emu_h0_grad(u_, delta_, A_, B_, C_, zk, bk, dout_, sp)
        cmp("dh0 alone", alone, dh0_no_dlast)
        if reach > 10 * tol:
            control("dh0 alone against dh0 with dlast", alone, th0.grad)
    if want_last:
        cmp("last_state", last, ref_last.detach())
        # negative control: the state one step before the end must fail the same check (with a margin)
        cut = slice(1, None) if reverse else slice(None, -1)  # in reverse the scan ends at t = 0
        # L == 1: the state before the only step
        early = th0.detach() if state else torch.zeros_like(ref_last)
        if L > 1:
            early = selective_scan_ref(tu.detach()[..., cut], tdl.detach()[..., cut], tA.detach(),
                                       tB.detach()[..., cut], tC.detach()[..., cut],
                                       delta_bias=tb.detach() if has_bias else None, delta_softplus=sp,
                                       return_last_state=True, reverse=reverse,
                                       h0=th0.detach() if state else None)[1]
        control("last_state", last, early)
    for name, mine, ref in zip(NAMES, grads, refs):
        cmp(name, mine, ref)
    return out, grads, res


def added(dtype, batch, dim, L, N, seed, order=0, reverse=False):
    """A bidirectional mixer's second direction adds its scan's output into the first's (ScanArgs::accumulate) and
    its conv's dx into the first's (ConvArgs::accumulate): every other output has the bits it has without, and the
    added ones the bits of the sum in float32 and float64 (one rounding either way), in bfloat16 the sum within its
    one rounding (the kernel adds before rounding). Overwriting (or adding twice: a pass that stored its output
    twice) fails the comparison. The backward scan does not add (set, the flag leaves its outputs as they were)."""
    lib.emu_config(order, seed, 0)
    lib.emu_set_reverse(int(reverse))
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    u, delta, z, dout, prev = (r(batch, dim, L) for _ in range(5))
    B, C = r(batch, N, L), r(batch, N, L)
    A = (-torch.exp(0.5 * torch.randn(dim, N, generator=g, dtype=torch.float64))).to(acc)
    D, bias = torch.randn(dim, generator=g, dtype=torch.float64).to(acc), 0.3 * torch.randn(dim, generator=g).to(acc)
    args = (u, delta, A, B, C, D, z, bias)

    def same_sum(got, a, b, what):
        if dtype in (torch.float32, torch.float64):
            assert torch.equal(got, a + b), f"{what}: not the bits of the sum ({dtype}, L={L}, dim={dim})"
        else:
            bound = 2 ** -7 * (a.double().abs() + b.double().abs()) + 1e-30
            assert ((got.double() - a.double() - b.double()).abs() <= bound).all(), f"{what}: off the sum ({dtype})"

    out, saved, _ = emu_fwd(*args, True, last_state=False)
    out_added, saved_added, _ = emu_fwd(*args, True, last_state=False, add_to=prev)
    assert torch.equal(saved_added, saved), "saved states differ when the output is added"
    same_sum(out_added, prev, out, "out")
    grads = emu_bwd(*args, dout, saved, True)
    lib.emu_set_accumulate(1)
    try:
        grads_set = emu_bwd(*args, dout, saved, True)
    finally:
        lib.emu_set_accumulate(0)
    for name, a, b in zip(NAMES, grads, grads_set):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{name}: the backward added"
    # the conv's dx (SiLU fused, as the branch runs it)
    K = 4
    w = (0.5 * torch.randn(dim, K, generator=g, dtype=torch.float64)).to(acc)
    dx, dx_added = torch.empty_like(u), prev.clone()
    dws = [torch.empty_like(w), torch.empty_like(w)]
    dbs = [torch.empty_like(bias), torch.empty_like(bias)]
    common = (DT[dtype], batch, dim, L, K, int(reverse), 1, dim * L, ptr(u), ptr(w), ptr(bias))
    for i, target in enumerate((dx, dx_added)):
        lib.emu_set_accumulate(i)
        try:
            err = lib.emu_conv(1, *common, ptr(dout), None, ptr(target), ptr(dws[i]), ptr(dbs[i]))
        finally:
            lib.emu_set_accumulate(0)
        assert err is None, err
    assert torch.equal(dws[0], dws[1]) and torch.equal(dbs[0], dbs[1]), "conv dw, dbias differ when dx is added"
    same_sum(dx_added, prev, dx, "conv dx")


def added_cases():
    """added() in every dtype the model trains in, both directions, with segments along the sequence and several
    blocks of channels (dim 20) and without (dim 5)."""
    n = 0
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for dim, L in ((5, 70), (20, 197)):
            added(dtype, 1, dim, L, 16, seed=7000 + n, order=n % 3, reverse=n % 2 == 1)
            n += 1
    return n


def conv_ref(x, w, bias, reverse):
    """The depthwise causal conv1d from its definition, in float64: c[t] = bias + sum_k w[k] x[t-(K-1)+k]; reverse:
    the same on the time-flipped sequence, flipped back."""
    K = w.shape[1]
    if reverse:
        return conv_ref(x.flip(-1), w, bias, False).flip(-1)
    return F.conv1d(F.pad(x, (K - 1, 0)), w.unsqueeze(1), bias, groups=x.shape[1])


def conv_case(dtype, batch, dim, L, K, has_bias, reverse, seed, order=0, sliced=False, silu=False):
    """The GPU conv's forward and backward (dx, dw, dbias) against autograd on conv_ref. `sliced`: x is the first
    half of a (batch, 2 dim, L) tensor, as the x half of in_proj's output would be; `silu`: the SiLU fused (the
    reference is silu(conv_ref), dout the gradient of that). -> (out, grads, errors)."""
    lib.emu_config(order, seed, seed % 2)
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    wide = torch.randn(batch, 2 * dim if sliced else dim, L, generator=g, dtype=torch.float64).to(dtype)
    x = wide[:, :dim]
    w = (0.5 * torch.randn(dim, K, generator=g, dtype=torch.float64)).to(acc)
    bias = torch.randn(dim, generator=g, dtype=torch.float64).to(acc) if has_bias else None
    dout = torch.randn(batch, dim, L, generator=g, dtype=torch.float64).to(dtype)
    out, dx = torch.empty(batch, dim, L, dtype=dtype), torch.empty(batch, dim, L, dtype=dtype)
    dw, dbias = torch.empty_like(w), torch.empty_like(bias) if has_bias else None
    stride = wide.stride(0)
    common = (DT[dtype], batch, dim, L, K, int(reverse), int(silu), stride, ptr(wide), ptr(w), ptr(bias))
    err = lib.emu_conv(0, *common, None, ptr(out), None, None, None)
    assert err is None, err
    err = lib.emu_conv(1, *common, ptr(dout), None, ptr(dx), ptr(dw), ptr(dbias))
    assert err is None, err
    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x, w, bias)]
    ref = conv_ref(*ref_in, reverse)
    ref = F.silu(ref) if silu else ref
    ref.backward(dout.double())
    errors = {}
    tol = TOL[dtype]
    for name, mine, want in (("out", out, ref.detach()), ("dx", dx, ref_in[0].grad), ("dw", dw, ref_in[1].grad),
                             ("dbias", dbias, ref_in[2].grad if has_bias else None)):
        if want is None:
            continue
        assert torch.isfinite(mine).all(), f"conv {name}: non-finite values (unwritten or poisoned)"
        errors[name] = ((mine.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        assert errors[name] < tol, f"conv {name}: rel err {errors[name]:.3g} > {tol} ({dtype}, L={L}, K={K})"
    if L > 1 and K > 1:  # negative control: the other direction's conv must fail the same check
        other = conv_ref(x.double(), w.double(), None if bias is None else bias.double(), not reverse)
        other = F.silu(other) if silu else other
        e = ((out.double() - other).abs().max() / other.abs().max()).item()
        assert e > 2 * tol, f"conv: the other direction passes too (rel err {e:.3g})"
        CONTROL["conv other direction"] = min(CONTROL.get("conv other direction", float("inf")), e)
    if silu:  # negative control: the gradients without silu' (dout taken as dc) must fail
        plain = [t.double().requires_grad_() if t is not None else None for t in (x, w, bias)]
        conv_ref(*plain, reverse).backward(dout.double())
        e = ((dx.double() - plain[0].grad).abs().max() / plain[0].grad.abs().max()).item()
        assert e > 2 * tol, f"conv: dx without silu' passes too (rel err {e:.3g})"
        CONTROL["conv silu'"] = min(CONTROL.get("conv silu'", float("inf")), e)
    return out, (dx, dw, dbias), errors


def conv_cases(quick):
    """Every dtype, both directions, with and without bias, widths 1-4 and 8, lengths around the tile sizes (one
    tile is at most 512 steps), x as a channel slice, with and without the fused SiLU (every other case: the
    branch's way; its random pre-activations fall on both sides of the sigmoid's x >= 0 branch); then the same
    bits under another thread/block order."""
    worst = {}
    Ls = [1, 3, 5, 33, 197, 513, 1100] if not quick else [1, 5, 197, 513]
    n = 0
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for L in Ls if dtype in (torch.float64, torch.float32) else [7, 197]:
            for K in ((4, 1, 2, 3, 8) if dtype == torch.float64 and L in (5, 197) else (4,)):
                m = n // 2  # the configuration's number: each runs with and without the SiLU
                for silu in (False, True):
                    _, _, res = conv_case(dtype, 2, 3, L, K, m % 2 == 0, m % 4 >= 2, seed=3000 + n, order=m % 3,
                                          sliced=m % 3 == 1, silu=silu)
                    for k, v in res.items():
                        name = ("conv+silu " if silu else "conv ") + k
                        worst[(dtype, name)] = max(worst.get((dtype, name), 0), v)
                    n += 1
    for silu in (False, True):
        a = conv_case(torch.float32, 3, 2, 700, 4, True, True, seed=99, order=0, silu=silu)
        b = conv_case(torch.float32, 3, 2, 700, 4, True, True, seed=99, order=1, silu=silu)
        for x, y in zip((a[0], *a[1]), (b[0], *b[1])):
            assert torch.equal(x, y), "conv: results depend on the thread/block order"
    return n + 4, worst


def check_deterministic(*args, **kw):
    """Run the same inputs twice (another block/thread order the second time) and compare every output bit."""
    a = case(*args, order=0, **kw)
    b = case(*args, order=1, **kw)
    assert torch.equal(a[0], b[0]), "out differs between two runs"
    for name, x, y in zip(NAMES, a[1], b[1]):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"{name} differs between two runs"


def lengths():
    t_start = time.time()
    worst = {}
    max_len = int(os.environ.get("EMU_MAX_LENGTH", "6085"))  # the test suite keeps to the short ones
    runs = [(5, L) for L in (1, 7, 65, 197, 785, 1025, 4097, 6085)] + [(20, L) for L in (197, 785, 1025)]
    for j, (reverse, (dim, L)) in enumerate((r, run) for run in runs if run[1] <= max_len for r in (False, True)):
        n_seg = lib.emu_num_segments(1, dim, L, 16, DT[torch.float32])
        state = j % 4 in (1, 2)  # from an initial state in both directions, at every other length
        _, _, res = case(torch.float32, 1, dim, L, 16, True, True, True, True, seed=L + dim, order=L % 3,
                         reverse=reverse, last_state=True, state=state)
        for k, v in res.items():
            worst[k] = max(worst.get(k, 0), v)
        print(f"  warp {WARP} L={L:5d} dim={dim:2d} segments={n_seg:3d} reverse={reverse!s:5s} state={state!s:5s}: "
              f"worst rel err {max(res.values()):.2e} ({time.time() - t_start:.0f}s)", flush=True)
    print("worst over lengths: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    print(f"  warp {WARP} last_state control: the state one step early is off by >= {CONTROL['last_state']:.2e} "
          f"(relative)")
    print(f"  warp {WARP} initial-state controls: the scan from zero is off by >= {CONTROL['from zero']:.2e}, "
          f"dh0 of the other direction by >= {CONTROL['dh0 of the other direction']:.2e}, dh0 without the last "
          f"state's gradient (where it reaches h0) by >= {CONTROL['dh0 without dlast']:.2e} (relative)")
    L = min(197, max_len)
    check_deterministic(torch.float32, 1, 20, L, 16, True, True, True, True, seed=11, reverse=True, state=True)
    print(f"  warp {WARP} deterministic: two runs at L={L}, dim 20, "
          f"{lib.emu_num_segments(1, 20, L, 16, 0)} segments, give the same bits")


def layout(batch, dim, L, N, dtype, backward):
    """(chunk, tiles, channels per block, blocks per batch element, segments, partials) the launcher picks now."""
    out = (ctypes.c_longlong * 6)()
    lib.emu_layout(batch, dim, L, N, DT[dtype], int(backward), out)
    return tuple(out)


# (chunk cap, tile cap, target blocks, partials) and the backward layout each must give at batch 2, dim 40, L 197,
# N 16 in float32 (8 channels a tile): (chunk, tiles, channels per block, blocks per batch element, segments,
# partials); None: the launcher's own chunk (32 with 32 lanes, 48 KiB of shared memory; 16 with 64, 32 KiB), and as
# many segments as segments of two chunks give, ceil(ceil(197 / chunk) / 2), where 4 blocks (batch x blocks of
# channels) are far below the 1024 aimed at. Several blocks of channels a row sum dB, dC in a chain, or (partials 1)
# write partials that the reduction adds.
LAYOUTS = [
    ((8, 0, 0, 0), (8, 4, 32, 2, None, 0)),      # short chunks: 25 of them, so 13 segments (two chunks each)
    ((16, 1, 0, 0), (16, 1, 8, 5, 7, 0)),        # one tile a block: a chain of 5 blocks of channels
    ((16, 1, 0, 1), (16, 1, 8, 5, 7, 1)),        # the same with dB/dC partials over the 5 blocks
    ((0, 2, 1, 0), (None, 2, 16, 3, 1, 0)),      # two tiles, one segment (the whole sequence in one block)
    ((32, 0, 100000, 1), (None, 4, 32, 2, None, 1)),  # as many segments as two chunks each allow, partials
]


def layouts():
    t_start = time.time()
    worst = {}
    own_chunk = lib.emu_chunk_length(16, DT[torch.float32])
    try:
        for j, (caps, want) in enumerate(LAYOUTS):
            err = lib.emu_set_tuning(*caps)
            assert err is None, err
            got = layout(2, 40, 197, 16, torch.float32, True)
            chunk = want[0] or min(own_chunk, caps[0] or own_chunk)
            n_seg = want[4] or -(-(-(-197 // chunk)) // 2)  # segments of kMinSegChunks = 2 chunks
            assert got == (chunk, *want[1:4], n_seg, want[5]), \
                f"caps {caps}: layout {got}, wanted {(chunk, *want[1:4], n_seg, want[5])}"
            for dtype in (torch.float64, torch.float32):
                _, _, res = case(dtype, 2, 40, 197, 16, True, True, True, True, seed=300 + j, order=j % 3,
                                 reverse=j % 2 == 1, last_state=True, state=j % 2 == 0)
                for k, v in res.items():
                    worst[(dtype, k)] = max(worst.get((dtype, k), 0), v)
            check_deterministic(torch.float32, 2, 40, 197, 16, True, True, True, True, seed=400 + j,
                                reverse=j % 2 == 0, state=True)
            added(torch.float32, 2, 40, 197, 16, seed=500 + j, order=j % 3, reverse=j % 2 == 1)
            print(f"  warp {WARP} caps chunk={caps[0]} tiles={caps[1]} blocks={caps[2]} partials={caps[3]}: chunk "
                  f"{got[0]}, {got[1]} tile(s) of {got[2] // got[1]} channels, {got[3]} blocks of channels, "
                  f"{got[4]} segments, {'partials' if got[5] else 'chain' if got[3] > 1 else 'direct'}: "
                  f"worst rel err {max(res.values()):.2e}, same bits in another order, out and the conv's dx "
                  f"added into ({time.time() - t_start:.0f}s)",
                  flush=True)
        assert lib.emu_set_tuning(3, 0, 0, 0) is not None and lib.emu_set_tuning(0, 5, 0, 0) is not None
        assert lib.emu_set_tuning(0, 0, 0, 2) is not None
    finally:
        lib.emu_set_tuning(0, 0, 0, 0)
    assert layout(2, 40, 197, 16, torch.float32, True)[0] == own_chunk
    print("worst over layouts: " + ", ".join(f"{str(d).replace('torch.', '')} {k} {v:.1e}"
                                             for (d, k), v in sorted(worst.items(), key=str)))


def races():
    """Each kernel instance and path Vim's shapes reach, every launch checked for racing accesses (check_races):
    one state a lane with groups of 8, 16 and 32 lanes (d_state 1, 16, 24: lanes without a state), several states a
    lane (33), each dtype, both directions, from an initial state (and the initial state's gradient alone), chunks
    partly past the end, segments along the sequence, several blocks of channels (their dB, dC sums in a chain, as
    partials, one tile a block), the outputs added into, and the conv with and without its SiLU. The numbers are
    checked as in the other modes, so a race reported here is one the results did not show."""
    t_start = time.time()
    n = 0
    for dtype, N in itertools.product((torch.float32, torch.bfloat16), (1, 16, 24, 33)):
        case(dtype, 2, 19, 70, N, True, True, True, True, seed=n, order=n % 3, reverse=n % 2 == 1, state=n % 3 == 0)
        n += 1
    for dtype in (torch.float64, torch.float16):
        case(dtype, 2, 11, 70, 16, n % 2 == 0, True, n % 2 == 1, True, seed=n, reverse=n % 2 == 0, state=True)
        n += 1
    for caps in ((0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0)):  # the chain, partials, one tile a block
        with_caps = lib.emu_set_tuning(*caps)
        assert with_caps is None, with_caps
        try:
            case(torch.float32, 2, 40, 197, 16, True, True, True, True, seed=n, reverse=n % 2 == 1, state=True)
        finally:
            lib.emu_set_tuning(0, 0, 0, 0)
        n += 1
    added(torch.float32, 2, 40, 197, 16, seed=n, reverse=True)
    added(torch.bfloat16, 1, 5, 70, 16, seed=n + 1)
    for j, (dtype, L, K) in enumerate(((torch.float32, 513, 4), (torch.bfloat16, 197, 3), (torch.float64, 33, 4))):
        for silu in (False, True):
            conv_case(dtype, 2, 3, L, K, j != 1, j % 2 == 1, seed=3000 + 2 * j + silu, sliced=j == 0, silu=silu)
    allowed = ", ".join(f"{where} ({n} pairs of accesses)" for (_, where), (_, n) in RACE_LOG["allowed"].items())
    print(f"warp {WARP} races: {RACE_LOG['launches']} launches of {len(RACE_LOG['kernels'])} kernel instances, "
          f"{RACE_LOG['accesses']} accesses to shared and global memory checked, the results right "
          f"({time.time() - t_start:.0f}s); allowed as marked \"{BENIGN}\": {allowed or 'none'}")
    print("  instances: " + "; ".join(sorted(k.replace("void ssk::", "") for k in RACE_LOG["kernels"])))
    if RACE_LOG["found"]:
        print(f"warp {WARP} races: FAILED, accesses a GPU does not order ({len(RACE_LOG['found'])} pairs of sites):")
        for (kind, where), (first, n) in RACE_LOG["found"].items():
            print(f"  {kind} [{where}], {n} pairs of accesses; the first: {first}")
        sys.exit(1)
    print(f"warp {WARP} races: none")


def main():
    if RACES:
        races()
        return
    if "--lengths" in sys.argv or "--layouts" in sys.argv:  # either or both, in this order
        if "--lengths" in sys.argv:
            lengths()
        if "--layouts" in sys.argv:
            layouts()
        return
    quick_cases("--quick" in sys.argv)


def quick_cases(quick=True):
    t_start = time.time()
    n = 0
    worst = {}
    # shape sweep in float64 (tight tolerance: exact algorithm) and float32
    Ls = [1, 7, 31, 33, 64, 65, 130] if not quick else [1, 33, 65]
    Ns = [1, 3, 16, 17, 32, 33, 64, 100, 256] if not quick else [1, 17, 33, 100]
    for dtype in (torch.float64, torch.float32):
        for L, N in itertools.product(Ls, Ns):
            G = 8
            while G < N and G < 32:
                G *= 2
            cpb = 128 // G
            dim = cpb + 3 if cpb > 1 else 3  # the last block of channels is partly empty
            flags = [(n + k) % 2 == 0 for k in range(4)]
            _, _, res = case(dtype, 2, dim, L, N, *flags, seed=n, order=n % 3, guard_front=n % 2,
                             reverse=n % 4 >= 2, state=n % 3 == 1)
            for k, v in res.items():
                worst[(dtype, k)] = max(worst.get((dtype, k), 0), v)
            n += 1
    # Every option on where a channel's group has lanes without a state (d_state 17: 32 lanes), which still
    # finish sums over n for the group (the scatter sums of the kernels), with D among them.
    for dtype in (torch.float64, torch.float32):
        _, _, res = case(dtype, 2, 7, 33, 17, True, True, True, True, seed=500 + n, reverse=n % 2 == 1)
        for k, v in res.items():
            worst[(dtype, k)] = max(worst.get((dtype, k), 0), v)
        n += 1
    # all flag combinations, and the low-precision dtypes
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for flags in itertools.product([False, True], repeat=4):
            if quick and dtype in (torch.float32, torch.float64) and sum(flags) not in (0, 4):
                continue
            _, _, res = case(dtype, 2, 11, 70, 16, *flags, seed=1000 + n, order=n % 3, reverse=n % 2 == 1,
                             state=n % 3 == 0)
            for k, v in res.items():
                worst[(dtype, k)] = max(worst.get((dtype, k), 0), v)
            n += 1
    # Vision Mamba-like lengths, and long sequences
    for L in ([197, 729, 1025] if not quick else [197]):
        case(torch.float32, 1, 9, L, 16, True, True, True, True, seed=2000 + L)
        n += 1
    if not quick:
        case(torch.float64, 1, 3, 4100, 5, True, True, True, True, seed=5000)
        case(torch.bfloat16, 1, 3, 4100, 16, True, True, True, True, seed=5001)
        n += 2
    # the result must not depend on thread/block order: every output, the summed gradients included, bitwise
    base = case(torch.float32, 2, 20, 45, 16, True, True, True, True, seed=7, order=0, state=True)
    for order in (1, 2):
        other = case(torch.float32, 2, 20, 45, 16, True, True, True, True, seed=7, order=order, state=True)
        assert torch.equal(base[0], other[0]), "out depends on scheduling order"
        for name, a, b in zip(NAMES, base[1], other[1]):
            assert torch.equal(a, b), f"{name} depends on scheduling order"
        n += 1
    n_conv, worst_conv = conv_cases(quick)
    worst.update(worst_conv)
    n += n_conv
    n_added = added_cases()
    n += n_added
    print(f"warp {WARP}: emulated {n} fwd+bwd cases (of which {n_conv} of the conv, {n_added} adding into out and "
          f"the conv's dx the bits of the sum) in {time.time() - t_start:.0f}s; "
          f"worst relative errors (negative controls, each off by at least: "
          f"{', '.join(f'{k} {v:.2e}' for k, v in CONTROL.items())}):")
    for (dtype, k), v in sorted(worst.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        print(f"  {str(dtype):15s} {k:12s} {v:.2e}")


if __name__ == "__main__":
    main()
