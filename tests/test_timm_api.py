"""Vim as a complete timm model: classifier API, forward_intermediates / features_only (class token in the middle
removed, tokens back on their grid), prune_intermediate_layers, gradient checkpointing with unchanged gradients,
torch.fx feature extraction, TorchScript's one-line refusal of script and torch.jit.trace + save + load, and
pretrained=True resolving to the published files.

Tiny configurations (depth 2-4, 32-48 pixel images) keep every test to a few seconds on a CPU.
"""
import subprocess
import sys
import warnings

import pytest
import timm
import torch

import vim_ds  # noqa: F401  (registers the models)
from vim_ds.models import VARIANTS, ALIASES, vim as vim_module

# (name, kwargs): even and odd patch counts, a stride-8 (overlapping patches) variant, a non-square image.
GEOMETRIES = {
    "p8_32px": ("vim_tiny", dict(img_size=32, patch_size=8, stride=8)),  # 4x4 grid, class token at 8
    "s8_48px": ("vim_small_s8", dict(img_size=48)),  # patch 16 stride 8: 5x5 grid, class token at 12
    "p8_32x48px": ("vim_tiny", dict(img_size=(32, 48), patch_size=8, stride=8)),  # 4x6 grid, class token at 12
}
TINY = dict(depth=3, embed_dim=32, num_classes=5)


def create(name="vim_tiny", **kw):
    return timm.create_model(name, **{**TINY, **kw})


def published_loop(model, x):
    """The published Vim forward, written out: (hidden, residual) through the blocks; returns the residual stream
    after every block (residual + that block's mixer output) and the final normalised tokens. Eval mode only."""
    tokens = model.patch_embed.proj(x).flatten(2).transpose(1, 2)
    pos = tokens.shape[1] // 2
    cls = model.cls_token.expand(x.shape[0], -1, -1)
    hidden = torch.cat((tokens[:, :pos], cls, tokens[:, pos:]), dim=1) + model.pos_embed
    residual, streams = None, []
    for layer in model.layers:
        hidden, residual = layer(hidden, residual)
        streams.append(residual + hidden)
    return streams, model.norm_f(streams[-1])


def test_classifier_api():
    m = create(img_size=32, patch_size=8, stride=8).eval()
    assert m.num_features == m.head_hidden_size == m.embed_dim == 32
    assert m.get_classifier() is m.head and m.head.out_features == 5
    x = torch.randn(2, 3, 32, 32)
    pre = m.forward_head(m.forward_features(x), pre_logits=True)
    assert pre.shape == (2, m.head_hidden_size)
    m.reset_classifier(11)
    assert m.num_classes == 11 and m(x).shape == (2, 11) and not m.head.training  # keeps the model's mode
    m.reset_classifier(0)
    torch.testing.assert_close(m(x), pre, rtol=0, atol=0)  # no head: the class token's features
    with pytest.raises(ValueError, match="global_pool='avg' is not supported"):
        m.reset_classifier(3, global_pool="avg")


def test_group_matcher_gives_one_group_per_block_for_layer_decay():
    from timm.models import group_parameters

    m = create(img_size=32, patch_size=8, stride=8, depth=4)
    groups = group_parameters(m, m.group_matcher())
    groups = list(groups.values())
    assert len(groups) == 1 + 4 + 1  # the stem, one per block (the final norm joins the last), the head
    assert sum(len(v) for v in groups) == len(list(m.named_parameters()))
    assert "pos_embed" in groups[0] and "cls_token" in groups[0] and "patch_embed.proj.weight" in groups[0]
    for i in range(4):
        assert all(n.startswith(f"layers.{i}.") for n in groups[1 + i] if n != "norm_f.weight")
    assert "norm_f.weight" in groups[4] and groups[5] == ["head.weight", "head.bias"]


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_forward_intermediates_are_the_residual_stream_on_the_patch_grid(geometry):
    torch.manual_seed(0)
    name, kw = GEOMETRIES[geometry]
    m = create(name, **kw).eval()
    gh, gw = m.patch_embed.grid_size
    x = torch.randn(2, 3, *m.patch_embed.img_size)
    with torch.no_grad():
        streams, final = published_loop(m, x)
        out, maps = m.forward_intermediates(x)
        feats = m.forward_features(x)
    pos = m.token_position
    assert pos == gh * gw // 2
    torch.testing.assert_close(out, feats, rtol=0, atol=0)
    torch.testing.assert_close(out, final, rtol=0, atol=0)
    assert len(maps) == 3
    for stream, fmap in zip(streams, maps):
        assert fmap.shape == (2, 32, gh, gw) and fmap.dtype == torch.float32
        # every map cell is the token of that patch: raster index r*gw + c, shifted past the class token
        for r, c in [(0, 0), (gh - 1, gw - 1), (gh // 2, gw // 2), (gh // 2 - 1, gw - 1), (1, 0)]:
            k = r * gw + c
            assert torch.equal(fmap[:, :, r, c], stream[:, k + (k >= pos)]), (r, c)
        # and no map cell is the class token
        assert not torch.isclose(fmap.flatten(2), stream[:, pos, :, None]).all(1).any()

    with torch.no_grad():
        nlc = m.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", norm=True, intermediates_only=True)
        pairs = m.forward_intermediates(x, indices=1, return_prefix_tokens=True, intermediates_only=True)
    assert len(nlc) == 2 and nlc[0].shape == (2, gh * gw, 32)
    for got, stream in zip(nlc, (streams[0], streams[-1])):
        normed = m.norm_f(stream)
        torch.testing.assert_close(got, torch.cat((normed[:, :pos], normed[:, pos + 1:]), 1), rtol=0, atol=0)
    (fmap, cls_tok), = pairs
    torch.testing.assert_close(fmap, maps[-1], rtol=0, atol=0)
    torch.testing.assert_close(cls_tok, streams[-1][:, pos:pos + 1], rtol=0, atol=0)


def test_forward_intermediates_indices_and_stop_early():
    torch.manual_seed(1)
    m = create(img_size=32, patch_size=8, stride=8, depth=4).eval()
    x = torch.randn(1, 3, 32, 32)
    calls = []
    for i, layer in enumerate(m.layers):
        layer.register_forward_hook(lambda mod, inp, out, i=i: calls.append(i))
    with torch.no_grad():
        _, every = m.forward_intermediates(x)
        calls.clear()
        early = m.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
    assert calls == [0, 1]  # blocks 2 and 3 never ran
    assert len(early) == 1 and torch.equal(early[0], every[1])
    with torch.no_grad():
        last2 = m.forward_intermediates(x, indices=2, intermediates_only=True)
    assert all(torch.equal(a, b) for a, b in zip(last2, every[2:]))
    with pytest.raises(ValueError, match="output_fmt"):
        m.forward_intermediates(x, output_fmt="NHWC")


@pytest.mark.parametrize("geometry", ["s8_48px", "p8_32x48px"])
def test_features_only_uses_timm_feature_getter(geometry):
    from timm.models._features import FeatureGetterNet

    name, kw = GEOMETRIES[geometry]
    torch.manual_seed(2)
    full = create(name, **kw, depth=4).eval()
    torch.manual_seed(2)  # same seed, same initialisation: the feature model is the same network, pruned
    fm = timm.create_model(name, features_only=True, out_indices=(0, 2), **{**TINY, **kw, "depth": 4}).eval()
    assert isinstance(fm, FeatureGetterNet)
    assert len(fm.model.layers) == 3 and isinstance(fm.model.norm_f, torch.nn.Identity)  # pruned after block 2
    stride = full.patch_embed.stride
    assert fm.feature_info.channels() == [32, 32] and fm.feature_info.reduction() == [stride, stride]
    assert fm.feature_info.module_name() == ["layers.0", "layers.2"]
    x = torch.randn(2, 3, *full.patch_embed.img_size)
    with torch.no_grad():
        got = fm(x)
        want = full.forward_intermediates(x, indices=(0, 2), intermediates_only=True)
    gh, gw = full.patch_embed.grid_size
    assert [tuple(t.shape) for t in got] == [(2, 32, gh, gw)] * 2
    # the map's stride is the reduction feature_info reports: patches every `stride` pixels
    assert gh == (full.patch_embed.img_size[0] - full.patch_embed.patch_size[0]) // stride + 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    default = timm.create_model(name, features_only=True, **{**TINY, **kw, "depth": 4})
    assert default.feature_info.module_name() == ["layers.1", "layers.2", "layers.3"]  # the last 3, as ViT
    with pytest.raises(ValueError, match="feature_cls='hook' is not supported"):
        timm.create_model(name, features_only=True, feature_cls="hook", **{**TINY, **kw})


def test_prune_keeps_the_last_blocks_stochastic_depth():
    m = create(img_size=32, patch_size=8, stride=8, depth=4, drop_path_rate=0.3)
    join = m.layers[2].drop_path
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(3)
    want = m.forward_intermediates(x, indices=[1], intermediates_only=True)[0]  # train mode: random depth
    assert m.prune_intermediate_layers([1], prune_norm=True) == [1]
    assert len(m.layers) == 2 and m.drop_path is join
    assert isinstance(m.head, torch.nn.Identity) and isinstance(m.norm_f, torch.nn.Identity)
    torch.manual_seed(3)
    got = m.forward_intermediates(x, indices=[1], intermediates_only=True)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _loss_and_grads(model, x, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the stochastic depth masks
    loss = model(x).logsumexp(-1).sum()
    loss.backward()
    return loss.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for n, p in model.named_parameters()}


def _assert_same(a, b):
    assert a[0].item() == pytest.approx(b[0].item(), rel=1e-6)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_grad_checkpointing_gives_the_same_gradients(monkeypatch):
    """fp32, train mode with stochastic depth: checkpointed blocks recompute in backward with the same masks."""
    torch.manual_seed(4)
    m = create(img_size=32, patch_size=8, stride=8, drop_path_rate=0.5).train()
    x = torch.randn(4, 3, 32, 32)
    runs = []
    # a pre-hook: the recomputation stops once it has what backward needs, before the block returns
    m.layers[1].register_forward_pre_hook(lambda *a: runs.append(1))
    plain = _loss_and_grads(m, x, seed=7)
    assert len(runs) == 1
    m.set_grad_checkpointing(True)
    runs.clear()
    ckpt = _loss_and_grads(m, x, seed=7)
    assert len(runs) == 2  # block 1 ran again in backward: its activations were not kept
    _assert_same(plain, ckpt)
    # different masks give different gradients: the comparison can tell the runs apart
    with pytest.raises(AssertionError):
        _assert_same(plain, _loss_and_grads(m, x, seed=8))

    # negative control: a "checkpoint" that drops block 1 (returns its input) must fail the same comparison
    real = torch.utils.checkpoint.checkpoint

    def dropping_checkpoint(fn, i, hidden, residual, **kw):
        return (hidden, residual) if i == 1 else real(fn, i, hidden, residual, **kw)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", dropping_checkpoint)
    with pytest.raises(AssertionError):
        _assert_same(plain, _loss_and_grads(m, x, seed=7))
    monkeypatch.undo()

    m.set_grad_checkpointing(False)
    runs.clear()
    _assert_same(plain, _loss_and_grads(m, x, seed=7))
    assert len(runs) == 1


def test_grad_checkpointing_keeps_fewer_activations():
    """What backward keeps alive after the forward: bytes of the tensors saved for backward (a memory measure
    that does not depend on the allocator). Vim-tiny at 224², batch 2: 112.6 MiB plain, 9.9 MiB + the 24 blocks'
    input pairs (14.1 MiB) checkpointed."""
    def saved_bytes(model, x):
        seen = {}

        def pack(t):
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).sum()
        loss.backward()
        return sum(seen.values())

    torch.manual_seed(5)
    m = create(img_size=32, patch_size=8, stride=8, depth=4, drop_path_rate=0.0).train()
    x = torch.randn(8, 3, 32, 32)
    plain = saved_bytes(m, x)
    m.set_grad_checkpointing(True)
    # a checkpoint keeps its inputs outside the saved-tensor hooks: the pair entering the block (the previous
    # mixer's output and the residual stream; the first block has no stream yet)
    stream_bytes = x.shape[0] * (m.patch_embed.num_patches + 1) * m.embed_dim * 4
    ckpt = saved_bytes(m, x) + (2 * len(m.layers) - 1) * stream_bytes
    assert ckpt < 0.5 * plain, (ckpt, plain)


def test_fx_feature_extraction_timm_and_torchvision():
    from timm.models import create_feature_extractor, get_graph_node_names
    from torchvision.models import feature_extraction as tv

    torch.manual_seed(6)
    m = create(img_size=48, patch_size=16, stride=8).eval()  # 5x5 grid, class token at 12
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        streams, _ = published_loop(m, x)
        logits = m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision: train/eval graphs differ (stochastic depth)
        nodes = get_graph_node_names(m)[1]
    # the residual stream after block i is the stream output of the next block's fused add and norm, the final
    # one's after the last block (listed in docs/models.md)
    blocks = ["layers.1.getitem_1", "layers.2.getitem_1", "getitem_4"]
    assert all(b in nodes for b in blocks) and "layers.0" not in nodes and "layers.0.mixer.bimamba_branch_fn" in nodes
    for create_extractor in (create_feature_extractor, tv.create_feature_extractor):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fx = create_extractor(m, return_nodes={**{b: f"block{i}" for i, b in enumerate(blocks)}, "head": "logits"})
        assert isinstance(fx, torch.fx.GraphModule)
        with torch.no_grad():
            out = fx(x)
        torch.testing.assert_close(out["logits"], logits, rtol=0, atol=0)
        for i, stream in enumerate(streams):
            torch.testing.assert_close(out[f"block{i}"], stream, rtol=0, atol=0)
        # the image-size check is a node of the graph: a wrong size is still the one-line error
        with pytest.raises(ValueError, match=r"input images are \(32, 32\), the model was built for \(48, 48\)"):
            fx(torch.randn(1, 3, 32, 32))


def test_torchscript_is_refused_in_one_clear_line():
    for model in (create(img_size=32, patch_size=8, stride=8),
                  timm.create_model("vim_tiny", features_only=True, **TINY, img_size=32, patch_size=8, stride=8)):
        with pytest.raises(RuntimeError) as info:
            torch.jit.script(model)
        message = str(info.value)
        assert "\n" not in message and "TorchScript" in message and "torch.compile" in message
        assert message == vim_module.TORCHSCRIPT_ERROR


# Loads a traced module in a fresh process: the scan and the fused SSM branch are torch.library ops, which a
# TorchScript module resolves by name, so `import vim_ds` (which registers them) is all the loader needs.
LOAD_TRACED = """
import sys, torch
import vim_ds
traced, io = torch.jit.load(sys.argv[1]), torch.load(sys.argv[2])
with torch.no_grad():
    assert torch.equal(traced(io["x"]), io["logits"]), "traced logits differ from eager"
    assert traced(io["x3"]).shape == (3, 5)
print("ok")
"""


def test_torch_jit_trace_saves_and_loads_in_a_fresh_process(tmp_path):
    """torch.jit.trace records the registered custom ops (vim_ds::bimamba_branch_fwd, ...) as graph nodes, so the
    traced module saves, and loads in a new process that imported vim_ds, with the eager logits (bit-exact, same
    CPU kernel) and for another batch size."""
    torch.manual_seed(0)
    model = create(img_size=32, patch_size=8, stride=8).eval()
    x, x3 = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trace's deprecation and shape-check TracerWarnings
        logits = model(x)
        traced = torch.jit.trace(model, x)
        assert any(n.kind().startswith("vim_ds::") for n in traced.inlined_graph.nodes())
    traced.save(str(tmp_path / "vim.pt"))
    torch.save({"x": x, "x3": x3, "logits": logits}, tmp_path / "io.pt")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", LOAD_TRACED, str(tmp_path / "vim.pt"),
                           str(tmp_path / "io.pt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("name", ["vim_tiny", "vim_small_s8", "vim_base"])
def test_pretrained_resolves_to_the_published_hugging_face_file(name, tmp_path, monkeypatch):
    """pretrained=True asks the hub for the published repository and file (intercepted: no network here) and loads
    what comes back, in the published {"model": state_dict} layout, through the checkpoint filter."""
    import timm.models._hub as hub

    full_name = ALIASES[name]
    repo, filename = VARIANTS[full_name][2]["hf_hub_id"], VARIANTS[full_name][2]["hf_hub_filename"]
    cfg = timm.models.get_pretrained_cfg(name)
    assert (cfg.hf_hub_id, cfg.hf_hub_filename) == (repo, filename)
    assert timm.models.get_pretrained_cfg(full_name).hf_hub_filename == filename
    assert repo.startswith("hustvl/Vim-") and filename.endswith(".pth")

    small = dict(depth=2, embed_dim=32, img_size=32, num_classes=1000)
    torch.manual_seed(9)
    source = timm.create_model(name, **small).eval()
    torch.save({"model": source.state_dict(), "epoch": 299}, tmp_path / filename)
    asked = []

    def fake_download(repo_id, filename, revision=None, cache_dir=None, **kw):
        asked.append((repo_id, filename))
        if filename.endswith(".safetensors"):  # timm first looks for a safetensors twin; the repos have none
            raise hub.EntryNotFoundError(f"{repo_id}/{filename}")
        return str(tmp_path / filename)

    monkeypatch.setattr(hub, "hf_hub_download", fake_download)
    torch.manual_seed(10)
    loaded = timm.create_model(name, pretrained=True, **small).eval()
    assert asked[-1] == (repo, filename)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), source(x), rtol=0, atol=0)


def test_grad_checkpointing_option_reaches_the_model_and_the_benchmark(monkeypatch, tmp_path):
    from vim_ds.cli import bench
    from vim_ds.cli.bench import train as bench_train
    from vim_ds.config.components import model_config
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    def build(argv):
        return model_config(RunConfig.from_dict(vars(parse_args(argv))), 10).build()

    tiny = ["--model-kwargs", "depth=2", "embed_dim=32", "patch_size=8", "stride=8", "--input-size", "32"]
    assert build(tiny + ["--grad-checkpointing"]).grad_checkpointing is True
    assert build(tiny).grad_checkpointing is False

    launched = []

    def fake_run(config, **kw):
        launched.append(kw["extra_args"])
        return {"config": config, "error": "not launched in this test"}

    monkeypatch.setattr(bench_train, "run_train_config", fake_run)
    bench.main(["train", "--configs", "zero0", "--grad-checkpointing", "--train-args", "--mixup 0",
                "--json", str(tmp_path / "out.json")])
    bench.main(["train", "--configs", "zero0"])
    assert launched == [["--mixup", "0", "--grad-checkpointing"], []]
    import json

    assert json.loads((tmp_path / "out.json").read_text())["settings"]["grad_checkpointing"] is True
