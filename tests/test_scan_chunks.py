"""The selective scan split along the sequence (issue 38, groundwork): chunks that pass the state on give the unsplit
scan, forward and every gradient, in both directions (vim_ds/ops/scan_chunks.py, selective_scan_ref's h0).

Float64 throughout. Each comparison is relative to the largest |value| of the unsplit result (TOL); the negative
controls (no state passed, the state passed the wrong way, the combine's operands swapped) must miss by at least
CONTROL_MIN, which is far above TOL (their measured size is printed and stated beside CONTROL_MIN).
"""
import pytest
import torch

from vim_ds.ops import scan_chunks
from vim_ds.ops.scan_chunks import chunk_pair, combine, decay_product, initial_states, state_correction
from vim_ds.ops.selective_scan_ref import selective_scan_ref

# Measured 2026-11-27 over 200 seeds x every case and split below, both directions: a split scan (one after another,
# from pairs corrected or rerun) differs from the unsplit one by at most 6.2e-15 of max |ref| (out, last state and
# the nine gradients; the worst on dA and ddelta_bias); the controls miss by at least 4.6e-2 (no state passed),
# 5.0e-2 (the combine's operands swapped), 1.5e-1 (the state passed the wrong way in the flipped direction).
TOL = 1e-12
CONTROL_MIN = 1e-4  # 1e8 x TOL, and over 400x below the smallest control measured

SHARED = {"A", "D", "delta_bias"}  # not indexed by time: every chunk reads all of it
BATCH, DIM, N, L = 2, 4, 3, 13  # L = 13 is prime: no split into 2, 3 or 4 chunks is even
SPLITS = [(8, 5), (12, 1), (1, 5, 7), (4, 1, 8), (3, 5, 4, 1), (1, 4, 1, 7)]  # each chunk of length 1 somewhere
CASES = {  # name: (form of B, form of C, D, z, delta_bias and h0 given, delta_softplus)
    "vim": ("input", "input", True, True),
    "bare": ("input", "input", False, False),
    "const-B-grouped-C": ("constant", "grouped", True, True),
}


def make_inputs(case):
    """Random float64 inputs in Mamba's regime (A < 0, delta around softplus' linear region), and douts (out, last)."""
    form_B, form_C, full, _ = CASES[case]
    f64 = dict(dtype=torch.float64)
    shapes = {"input": (BATCH, N, L), "constant": (DIM, N), "grouped": (BATCH, 2, N, L)}
    inputs = {
        "u": torch.randn(BATCH, DIM, L, **f64),
        "delta": 0.5 * torch.randn(BATCH, DIM, L, **f64),
        "A": -torch.exp(0.5 * torch.randn(DIM, N, **f64)),
        "B": torch.randn(*shapes[form_B], **f64),
        "C": torch.randn(*shapes[form_C], **f64),
        "D": torch.randn(DIM, **f64) if full else None,
        "z": torch.randn(BATCH, DIM, L, **f64) if full else None,
        "delta_bias": 0.5 * torch.randn(DIM, **f64) if full else None,
        "h0": torch.randn(BATCH, DIM, N, **f64) if full else None,
    }
    if not CASES[case][3]:  # a negative step would grow the state (exp(delta A) > 1) and swamp every comparison
        inputs["delta"] = torch.nn.functional.softplus(inputs["delta"])
    return inputs, (torch.randn(BATCH, DIM, L, **f64), torch.randn(BATCH, DIM, N, **f64))


def softplus(case):
    return CASES[case][3]


def bounds(lengths):
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def chunk(inputs, start, end):
    """The chunk's inputs (h0 dropped): time-indexed ones sliced, constant B/C and the per-channel ones whole."""
    def cut(name, x):
        if x is None or name in SHARED or x.dim() == 2:
            return x
        return x[..., start:end]
    return {name: cut(name, x) for name, x in inputs.items() if name != "h0"}


def flipped(inputs):
    return {name: (x if x is None or name in SHARED or name == "h0" or x.dim() == 2 else x.flip(-1))
            for name, x in inputs.items()}


def evaluate(fn, inputs, douts):
    """(out, last, {name: grad}) of fn(leaves) -> (out, last), backward from (out, last) . douts."""
    leaves = {k: (v.detach().clone().requires_grad_(True) if v is not None else None) for k, v in inputs.items()}
    out, last = fn(leaves)
    ((out * douts[0]).sum() + (last * douts[1]).sum()).backward()
    return out.detach(), last.detach(), {k: v.grad for k, v in leaves.items() if v is not None}


def rel(got, want):
    """The largest |got - want| relative to the largest |want|."""
    return (got - want).abs().max().item() / (want.abs().max().item() + 1e-300)


def worst(got, want):
    """The largest relative difference over out, last and every gradient, and which one it is."""
    rows = [("out", got[0], want[0]), ("last", got[1], want[1])]
    rows += [(f"d{k}", got[2][k], want[2][k]) for k in want[2]]
    assert set(got[2]) == set(want[2])
    return max((rel(g, w), name) for name, g, w in rows)


def assert_same(got, want):
    err, name = worst(got, want)
    print(f"worst difference from the unsplit scan: {err:.2e} ({name})")
    assert err <= TOL, f"{name}: differs from the unsplit scan by {err:.3e} x max |ref| > {TOL:.0e}"


def assert_control_fails(got, want, what):
    err, name = worst(got, want)
    print(f"control ({what}): misses by {err:.2e} ({name})")
    assert err >= CONTROL_MIN, f"the control ({what}) misses by only {err:.3e} <= {CONTROL_MIN:.0e}: the test is blind"


# -- the unsplit scan and the two ways of running it in chunks -------------------------------------------------------

def unsplit(sp, reverse=False):
    """The whole sequence in one scan; reverse: the flipped sequence scanned forward, and its output flipped back."""
    def fn(x):
        if not reverse:
            return selective_scan_ref(**x, delta_softplus=sp, return_last_state=True)
        out, last = selective_scan_ref(**flipped(x), delta_softplus=sp, return_last_state=True)
        return out.flip(-1), last
    return fn


def one_after_another(lengths, sp, reverse=False, order=None, pass_state=True):
    """Scan the chunks one at a time (in `order`: default first to last, or last to first with reverse), each from
    the state the one before it left via h0 (the first from the whole scan's h0)."""
    spans = bounds(lengths)
    order = order or (list(reversed(range(len(spans)))) if reverse else list(range(len(spans))))

    def fn(x):
        outs, h = [None] * len(spans), x["h0"]
        for i, k in enumerate(order):
            h_in = h if (pass_state or i == 0) else None
            outs[k], h = selective_scan_ref(**chunk(x, *spans[k]), delta_softplus=sp, return_last_state=True,
                                            reverse=reverse, h0=h_in)
        return torch.cat(outs, -1), h
    return fn


def from_pairs(lengths, sp, reverse=False, states_reverse=None, rerun=False, pass_state=True):
    """LASP-2's scheme: every chunk scanned from zero and its pair formed independently, the pairs combined into each
    chunk's initial state, then each chunk corrected (or rerun from it). `states_reverse` other than `reverse`: the
    states passed the wrong way (a control)."""
    spans = bounds(lengths)
    states_reverse = reverse if states_reverse is None else states_reverse

    def fn(x):
        chunks = [chunk(x, *span) for span in spans]
        pairs = [chunk_pair(c["u"], c["delta"], x["A"], c["B"], x["delta_bias"], sp, reverse=reverse) for c in chunks]
        starts = initial_states(pairs, x["h0"], reverse=states_reverse)
        if not pass_state:  # every chunk but the first to run starts from zero
            first = len(spans) - 1 if states_reverse else 0
            starts = [h if k == first else torch.zeros_like(h) for k, h in enumerate(starts)]
        outs = []
        for c, h_in in zip(chunks, starts):
            if rerun:
                outs.append(selective_scan_ref(**c, delta_softplus=sp, reverse=reverse, h0=h_in))
            else:
                out = selective_scan_ref(**c, delta_softplus=sp, reverse=reverse)
                outs.append(out + state_correction(h_in, c["delta"], x["A"], c["C"], c["z"], x["delta_bias"], sp,
                                                   reverse=reverse))
        k = 0 if reverse else len(spans) - 1  # the chunk that runs last hands on the final state
        P, S = pairs[k]
        return torch.cat(outs, -1), P * starts[k] + S
    return fn


def ids(lengths):
    return "+".join(map(str, lengths))


# -- the reference's initial state -----------------------------------------------------------------------------------

@pytest.mark.parametrize("reverse", [False, True])
def test_h0_zero_is_bitwise_no_h0(reverse, seed):
    inputs, _ = make_inputs("vim")
    h0 = inputs.pop("h0")
    want = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True, reverse=reverse)
    got = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True, reverse=reverse,
                             h0=torch.zeros_like(h0))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("reverse", [False, True])
def test_h0_adds_its_decayed_projection(reverse, seed):
    """Independently of the scan's loop: out(h0) - out(0) is state_correction(h0), whose h0 gradient is checked
    against finite differences, as the reference's is."""
    inputs, _ = make_inputs("vim")
    h0 = inputs.pop("h0")
    with_h0 = selective_scan_ref(**inputs, delta_softplus=True, reverse=reverse, h0=h0)
    without = selective_scan_ref(**inputs, delta_softplus=True, reverse=reverse)
    added = state_correction(h0, inputs["delta"], inputs["A"], inputs["C"], inputs["z"], inputs["delta_bias"], True,
                             reverse=reverse)
    err = rel(with_h0 - without, added)
    print(f"out(h0) - out(0) vs state_correction: {err:.2e}")
    assert err <= TOL
    small = {k: (v[:1, :2, :5] if k in ("u", "delta", "z") else v[:1, :, :5] if k in ("B", "C")
                 else v[:2] if v.dim() else v) for k, v in inputs.items()}
    for fn in (lambda h: selective_scan_ref(**small, delta_softplus=True, reverse=reverse, h0=h),
               lambda h: state_correction(h, small["delta"], small["A"], small["C"], small["z"], small["delta_bias"],
                                          True, reverse=reverse)):
        assert torch.autograd.gradcheck(fn, (h0[:1, :2].clone().requires_grad_(True),))


def test_h0_of_the_wrong_shape_is_refused():
    inputs, _ = make_inputs("vim")
    with pytest.raises(ValueError, match=r"h0 must be of shape \(batch, dim, d_state\) = \(2, 4, 3\), got \(4, 3\)"):
        selective_scan_ref(**dict(inputs, h0=inputs["h0"][0]))


# -- the algebra of pairs ------------------------------------------------------------------------------------------

def test_combine_is_associative_with_identity_and_not_commutative(seed):
    pairs = [(torch.rand(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)) for _ in range(3)]
    a, b, c = pairs
    for x, y in zip(combine(combine(a, b), c), combine(a, combine(b, c))):
        assert rel(x, y) <= TOL
    one = (torch.ones_like(a[0]), torch.zeros_like(a[1]))
    for x, y in zip(combine(one, a), a):
        assert torch.equal(x, y)
    assert rel(combine(b, a)[1], combine(a, b)[1]) >= CONTROL_MIN


@pytest.mark.parametrize("reverse", [False, True])
def test_a_chunks_pair_maps_its_initial_state(reverse, seed):
    """P h_in + S is the chunk's final state started from h_in; P is the product of its per-step decays."""
    inputs, _ = make_inputs("vim")
    x = chunk(inputs, 3, 9)
    P, S = chunk_pair(x["u"], x["delta"], inputs["A"], x["B"], inputs["delta_bias"], True, reverse=reverse)
    _, last = selective_scan_ref(**x, delta_softplus=True, return_last_state=True, reverse=reverse, h0=inputs["h0"])
    assert rel(P * inputs["h0"] + S, last) <= TOL
    d = torch.nn.functional.softplus(x["delta"] + inputs["delta_bias"][:, None])
    steps = torch.exp(d.unsqueeze(-1) * inputs["A"][None, :, None, :])  # (batch, dim, L, N)
    assert rel(decay_product(x["delta"], inputs["A"], inputs["delta_bias"], True), steps.prod(2)) <= TOL


# -- (a) chunks one after another, (b) from pairs, (c) the flipped direction, and their controls ----------------------

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lengths", SPLITS, ids=ids)
def test_chunks_one_after_another_equal_the_unsplit_scan(lengths, case, seed):
    inputs, douts = make_inputs(case)
    want = evaluate(unsplit(softplus(case)), inputs, douts)
    assert_same(evaluate(one_after_another(lengths, softplus(case)), inputs, douts), want)
    assert_control_fails(evaluate(one_after_another(lengths, softplus(case), pass_state=False), inputs, douts), want,
                         "later chunks start from zero")


@pytest.mark.parametrize("rerun", [False, True], ids=["corrected", "rerun"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lengths", SPLITS, ids=ids)
def test_chunks_from_combined_pairs_equal_the_unsplit_scan(lengths, case, rerun, seed, monkeypatch):
    inputs, douts = make_inputs(case)
    sp = softplus(case)
    want = evaluate(unsplit(sp), inputs, douts)
    assert_same(evaluate(from_pairs(lengths, sp, rerun=rerun), inputs, douts), want)
    assert_control_fails(evaluate(from_pairs(lengths, sp, rerun=rerun, pass_state=False), inputs, douts), want,
                         "no initial states")
    if inputs["h0"] is not None or len(lengths) > 2:  # with h0 = 0 and 2 chunks the one combine meets the identity
        monkeypatch.setattr(scan_chunks, "combine", lambda first, second: combine(second, first))
        assert_control_fails(evaluate(from_pairs(lengths, sp, rerun=rerun), inputs, douts), want, "operands swapped")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lengths", SPLITS, ids=ids)
def test_flipped_direction_passes_the_state_from_later_chunks(lengths, case, seed, monkeypatch):
    """Vim's backward mixer: reverse scans of the chunks, the state handed from each chunk to the one before it,
    equal the unsplit scan of the flipped sequence (flipped back), forward and every gradient, both schemes."""
    inputs, douts = make_inputs(case)
    sp = softplus(case)
    want = evaluate(unsplit(sp, reverse=True), inputs, douts)
    assert_same(evaluate(one_after_another(lengths, sp, reverse=True), inputs, douts), want)
    assert_same(evaluate(from_pairs(lengths, sp, reverse=True), inputs, douts), want)
    assert_same(evaluate(from_pairs(lengths, sp, reverse=True, rerun=True), inputs, douts), want)
    forward_order = list(range(len(lengths)))
    assert_control_fails(evaluate(one_after_another(lengths, sp, reverse=True, order=forward_order), inputs, douts),
                         want, "state handed to the next chunk")
    assert_control_fails(evaluate(from_pairs(lengths, sp, reverse=True, states_reverse=False), inputs, douts), want,
                         "prefix instead of suffix")
    assert_control_fails(evaluate(one_after_another(lengths, sp, reverse=True, pass_state=False), inputs, douts),
                         want, "earlier chunks start from zero")
    if inputs["h0"] is not None or len(lengths) > 2:
        monkeypatch.setattr(scan_chunks, "combine", lambda first, second: combine(second, first))
        assert_control_fails(evaluate(from_pairs(lengths, sp, reverse=True), inputs, douts), want, "operands swapped")
