"""`vim-ds bench anatomy` (cli/bench/step_anatomy.py): a training step on paper, each operator of one forward and
backward (traced on the meta device) and the optimizer step beside its roofline on a modelled GPU (issue 51, item
2's rooflines for every operator, not only the matrix products, scans and convs a profile names). Checked on a small
Vim against byte and FLOP counts worked out here by hand from the shapes, and against the H200's datasheet rates."""
from __future__ import annotations

import json

import pytest
import timm
import torch

from vim_ds.cli.bench import main as bench_main
from vim_ds.cli.bench import scan_model, step_anatomy
from vim_ds.ops import rms_norm, rms_norm_triton

SMALL = dict(depth=2, embed_dim=32, patch_size=8, stride=8, num_classes=10)  # 16 patches + the class token
BATCH, SIZE, TOKENS, D_INNER = 4, 32, 17, 64
H200 = {g.name: g for g in scan_model.GPUS}["H200 SXM"]


@pytest.fixture(scope="module")
def ops():
    with torch.device("meta"):
        model = timm.create_model("vim_tiny", img_size=SIZE, **SMALL)
    return step_anatomy.trace(model.train(), BATCH, SIZE, "fp32", H200)


def _named(ops, name, shape=None):
    return [o for o in ops if o.name == name and (shape is None or o.shape == shape)]


def test_every_operator_beside_its_roofline_from_the_shapes(ops):
    # views and allocations move nothing and are not listed; every listed op has a kind and a positive cost
    # the same kinds for a traced op and a profiled one (`vim-ds bench profile`'s names)
    classify = step_anatomy.classify
    assert classify("aten.transpose.int") is None and classify("aten.view.default") is None is classify("aten::t")
    assert classify("aten.add.Tensor") == "elementwise" == classify("aten::add")
    assert classify("aten.bmm.default") == "matrix products" == classify("aten::baddbmm")
    assert classify("aten._to_copy.default") == "casts and copies" == classify("aten::copy_")
    assert classify("vim_ds.ssm_branch_bwd.default") == step_anatomy.BRANCH_KIND == classify("vim_ds::causal_conv1d")
    assert all(o.kind in step_anatomy.KINDS and o.bytes > 0 and o.seconds > 0 for o in ops)
    assert not [o for o in ops if o.name.startswith(("aten.transpose", "aten.view", "aten.expand", "aten.detach"))]
    # the head: addmm(bias, x, W^T) reads bias, the class tokens and the weight, writes the logits; 2 B C K FLOPs
    head = _named(ops, "aten.addmm.default", (BATCH, 10))
    assert len(head) == 1
    assert head[0].bytes == (10 + BATCH * 32 + 32 * 10 + BATCH * 10) * 4
    assert head[0].flops == 2 * BATCH * 32 * 10
    assert head[0].seconds == pytest.approx(max(head[0].bytes / 4.8e12, head[0].flops / 67e12))
    # the mixer's two directions summed forward, and their gradients of x and z summed backward, inside the op: the
    # second direction's scan reads the first's out back in its store, its conv the first's dx; dz is one add (two
    # (batch, d_inner, L) fp32 tensors read, one written); no add of the model's own is left
    assert not _named(ops, "aten.add.Tensor", (BATCH, D_INNER, TOKENS))
    bdl_bytes = BATCH * D_INNER * TOKENS * 4
    for name, nbytes in (("vim_ds.bimamba_branch_fwd: the directions' sum (out read back)", bdl_bytes),
                         ("vim_ds.bimamba_branch_bwd: the directions' sum (the conv's dx read back)", bdl_bytes),
                         ("vim_ds.bimamba_branch_bwd: the directions' dz summed", 3 * bdl_bytes)):
        summed = _named(ops, name)
        assert len(summed) == SMALL["depth"] and all(o.bytes == nbytes for o in summed), name
    # in_proj's halves: a bmm of the weight expanded over the batch (stride 0) reads the weight once, not once a
    # sample (what the expanded tensor's numel would say: 4 x 8 kB more here, 2.7 GB a Vim-small-s8 step)
    in_proj = _named(ops, "aten.bmm.default", (BATCH, D_INNER, TOKENS))
    assert len(in_proj) == 3 * SMALL["depth"]  # x, z forward; out_proj's input gradient backward
    assert in_proj[0].bytes == (D_INNER * 32 + BATCH * TOKENS * 32 + BATCH * D_INNER * TOKENS) * 4
    assert step_anatomy.footprint(torch.empty(D_INNER, 32, device="meta").expand(BATCH, -1, -1)) == D_INNER * 32 * 4
    # stochastic depth's mask: new_ones reads nothing of the tensor it takes its dtype from (the (batch, L, dim)
    # hidden states), and bernoulli_ only writes
    for name in ("aten.new_ones.default", "aten.bernoulli_.float"):
        drawn = _named(ops, name)
        assert drawn and all(o.bytes == BATCH * 4 for o in drawn), name
    # the optimizer: 28 bytes a parameter
    n_params = sum(p.numel() for p in timm.create_model("vim_tiny", img_size=SIZE, **SMALL).parameters())
    adam = _named(ops, "AdamW step (fused, analytic)")
    assert len(adam) == 1 and adam[0].bytes == 28 * n_params


def test_the_branch_ops_are_their_parts_and_the_norms_one_kernel_each_way(ops):
    blocks = 2 * SMALL["depth"]  # two directions a block
    fwd = [o for o in ops if o.name.startswith("vim_ds.bimamba_branch_fwd") and "directions" not in o.name]
    bwd = [o for o in ops if o.name.startswith("vim_ds.bimamba_branch_bwd") and "directions" not in o.name]
    assert len(fwd) == 5 * blocks and len(bwd) == 9 * blocks
    # a GPU profile gives the projections' and copies' kernels to the bmm and copy inside the op: so does the trace
    assert {o.name.split(": ")[1]: o.kind for o in fwd} == {
        "conv + SiLU": step_anatomy.BRANCH_KIND, "x_proj": "matrix products", "dt_proj": "matrix products",
        "B, C copies": "casts and copies", "scan": step_anatomy.BRANCH_KIND}
    scan = _named(ops, "vim_ds.bimamba_branch_fwd: scan")
    cost = scan_model.forward_cost(BATCH, D_INNER, TOKENS, 16, "float32")
    assert len(scan) == blocks and scan[0].bytes == cost.bytes
    assert scan[0].seconds == pytest.approx(cost.bound(H200)["seconds"])
    # the conv reads x and writes u: two (batch, d_inner, L) tensors; backward x and du in, dx out
    bdl = BATCH * D_INNER * TOKENS
    assert _named(ops, "vim_ds.bimamba_branch_fwd: conv + SiLU")[0].bytes == 2 * bdl * 4
    assert _named(ops, "vim_ds.bimamba_branch_bwd: conv + SiLU backward")[0].bytes == 3 * bdl * 4
    # x_proj: u in, x_dbl (dt_rank 2 + 2 x 16 rows) out, 2 x rows FLOPs a (b, d, t)
    x_proj = _named(ops, "vim_ds.bimamba_branch_fwd: x_proj")[0]
    assert x_proj.bytes == (bdl + BATCH * 34 * TOKENS) * 4 and x_proj.flops == 2 * bdl * 34
    rows, dim = BATCH * TOKENS, 32
    if rms_norm_triton.available():  # each block's add and norm and the final ones: one kernel forward, one backward
        forward = _named(ops, "vim_ds.add_rms_norm_fwd.default")
        backward = _named(ops, "vim_ds.add_rms_norm_bwd.default")
        assert len(forward) == SMALL["depth"] + 1 == len(backward)
        assert {o.kind for o in forward + backward} == {"norms"}
        # the first block's has no residual: x, weight in; y, the stream, rstd out; the others read the residual too,
        # and the final one (the last block's output joins through the model's stochastic depth, 0.1) each sample's
        # scale (mask / keep: no separate multiply)
        assert forward[0].bytes == (3 * rows * dim + dim + rows) * 4
        assert forward[1].bytes == (4 * rows * dim + dim + rows) * 4
        assert forward[2].bytes == (4 * rows * dim + dim + rows + BATCH) * 4
        # backward (in reverse order): the final norm's stream has no gradient from downstream; the blocks' do
        assert backward[0].bytes == (4 * rows * dim + 2 * dim + rows + BATCH) * 4
        assert backward[1].bytes == (5 * rows * dim + 2 * dim + rows) * 4
        assert not _named(ops, "aten.mul.Tensor", (BATCH, TOKENS, dim))
        # no separate add, norm or cast over the (batch, tokens, dim) stream is left but the embedding's position
        # add (forward: the mixers' outputs join the stream inside the op; backward: the stream's gradients too)
        stream_ops = [o.name for o in ops if o.shape == (BATCH, TOKENS, dim) and (
            o.kind == "norms" or o.name.startswith(("aten.add", "aten._to_copy")))]
        assert stream_ops == ["aten.add.Tensor"] + ["vim_ds.add_rms_norm_fwd.default"] * (SMALL["depth"] + 1) + [
            "vim_ds.add_rms_norm_bwd.default"] * (SMALL["depth"] + 1)


def test_without_the_fused_kernel_the_norms_are_torchs(monkeypatch):
    """VIM_DS_NORM=ref (and a torch without triton): the add, then torch's fused RMSNorm, one kernel forward and one
    backward, or on older torch the formula as its operators."""
    monkeypatch.setenv("VIM_DS_NORM", "ref")
    with torch.device("meta"):
        model = timm.create_model("vim_tiny", img_size=SIZE, **SMALL)
    ops = step_anatomy.trace(model.train(), BATCH, SIZE, "fp32", H200)
    assert not [o for o in ops if o.name.startswith("vim_ds.add_rms_norm")]
    norms = [o for o in ops if o.kind == "norms"]
    if rms_norm.TORCH_FUSES_RMS_NORM:
        rows, dim = BATCH * TOKENS, 32
        forward = _named(ops, "aten._fused_rms_norm")
        assert len(forward) == SMALL["depth"] + 1 == len(_named(ops, "aten._fused_rms_norm_backward"))
        assert forward[0].bytes == (2 * rows * dim + dim + rows) * 4  # x, weight in; y, rstd out
        assert len(norms) == 2 * (SMALL["depth"] + 1) and not _named(ops, "aten.rsqrt.default")
    else:  # older torch: the model's formula, traced as its operators
        assert not norms and _named(ops, "aten.rsqrt.default")


def test_bench_anatomy_prints_the_step_by_kind_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "a.json"
    assert bench_main(["anatomy", "--model", "vim_tiny", "--model-kwargs", "depth=2", "embed_dim=32",
                       "patch_size=8", "stride=8", "num_classes=10", "--input-size", str(SIZE), "--batch-size",
                       str(BATCH), "--precision", "bf16", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A training step of vim_tiny depth=2 embed_dim=32 patch_size=8 stride=8 num_classes=10 "
                          "on paper: batch 4 at 32 px, bf16")
    assert "| kind | ops | GB | GFLOP | roofline ms | share |" in out and "The costliest operators" in out
    result = json.loads(out_json.read_text())
    kinds = {k["kind"]: k for k in result["kinds"]}
    assert set(kinds) <= set(step_anatomy.KINDS) and step_anatomy.BRANCH_KIND in kinds
    assert sum(k["ms"] for k in result["kinds"]) == pytest.approx(result["total_ms"])
    assert result["images_per_s"] == pytest.approx(BATCH / result["total_ms"] * 1e3)
    assert result["settings"]["matrix_TFLOPS"] == pytest.approx(989.4)  # bf16's dense tensor-core peak
    # bad input: one line, exit 2
    for argv, message in ((["--gpu", "A100"], "--gpu must be one of"),
                          (["--model", "no_such_model"], "unknown model 'no_such_model' (try vim_tiny"),
                          (["--model-kwargs", "img_size=64"], "give the image size as --input-size")):
        assert bench_main(["anatomy", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
