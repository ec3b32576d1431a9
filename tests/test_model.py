"""Vim models: timm registry, published initialisation, checkpoint loading (safe, strict, adapted), backends agree."""
import argparse
import math
import os

import pytest
import timm
import torch

import vim_ds  # noqa: F401  (registers the models)
from vim_ds.checkpoint import CheckpointError, load_model_weights
from vim_ds.models import ALIASES, VARIANTS, resample_pos_embed

SMALL = dict(depth=2, embed_dim=32, img_size=32, num_classes=7)


def small(name="vim_tiny", **kw):
    return timm.create_model(name, **{**SMALL, **kw})


def test_every_published_name_and_alias_is_registered():
    for name in list(VARIANTS) + list(ALIASES):
        assert name in timm.list_models("vim_*"), name
    assert ALIASES["vim_small_s8"].startswith("vim_small_patch16_stride8_224")
    assert ALIASES["vim_base"].endswith("with_middle_cls_token_div2")


def test_create_model_kwargs_and_pretrained_cfg():
    m = timm.create_model("vim_small_s8", num_classes=10, img_size=64, drop_path_rate=0.2, depth=3, embed_dim=48)
    assert len(m.layers) == 3 and m.embed_dim == 48 and m.head.out_features == 10
    assert m.patch_embed.grid_size == (7, 7)  # (64 - 16) // 8 + 1
    assert m.pos_embed.shape == (1, 50, 48)
    assert m.pretrained_cfg["hf_hub_filename"] == "vim_s_midclstok_ft_81p6acc.pth"
    assert m.pretrained_cfg["interpolation"] == "bicubic" and m.pretrained_cfg["crop_pct"] == 0.875
    # stochastic depth: linear up to drop_path_rate, applied to mixer i's output as it joins the stream
    assert isinstance(m.layers[0].drop_path, torch.nn.Identity)
    assert m.layers[2].drop_path.drop_prob == pytest.approx(0.1)
    assert m.drop_path.drop_prob == pytest.approx(0.2)


def test_published_initialisation():
    torch.manual_seed(0)
    m = timm.create_model("vim_tiny", depth=4, embed_dim=64, img_size=32)
    mixer = m.layers[0].mixer
    expected_A = torch.arange(1, 17, dtype=torch.float32).repeat(mixer.d_inner, 1)
    torch.testing.assert_close(torch.exp(mixer.A_log), expected_A)  # S4D-real
    torch.testing.assert_close(torch.exp(mixer.A_b_log), expected_A)
    assert torch.equal(mixer.D, torch.ones(mixer.d_inner))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7  # inverse-softplus init in [dt_min, dt_max]
    assert torch.count_nonzero(mixer.dt_proj_b.bias) == 0  # published: the backward dt bias is zeroed
    bound = 1 / math.sqrt(mixer.d_inner) / math.sqrt(4)  # kaiming_uniform(a=sqrt 5) scaled by 1/sqrt(depth)
    assert mixer.out_proj.weight.abs().max() <= bound + 1e-7
    assert mixer.out_proj.weight.abs().max() > 0.8 * bound
    assert m.pos_embed.std().item() == pytest.approx(0.02, rel=0.2)
    assert torch.count_nonzero(m.head.bias) == 0


def test_forward_backward_shapes_and_class_token_in_the_middle():
    m = small().eval()  # eval: no stochastic depth, so the two paths below are comparable
    x = torch.randn(3, 3, 32, 32)
    assert m.token_position == 2  # 2x2 patches -> class token at index 2
    feats = m.forward_features(x)
    assert feats.shape == (3, 5, 32)
    logits = m(x)
    assert logits.shape == (3, 7)
    torch.testing.assert_close(logits, m.head(feats[:, 2]))
    logits.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_wrong_image_size_is_a_clear_error():
    with pytest.raises(ValueError, match=r"input images are \(48, 48\), the model was built for \(32, 32\)"):
        small()(torch.randn(1, 3, 48, 48))


def test_cpu_kernel_and_reference_give_the_same_model(monkeypatch):
    """Whole model, float64, train mode without randomness: logits and every parameter gradient agree."""
    torch.manual_seed(1)
    m = small(drop_path_rate=0.0).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    results = {}
    for backend in ("ref", "cpu"):
        monkeypatch.setenv("VIM_DS_SCAN", backend)
        m.zero_grad()
        out = m(x)
        out.square().sum().backward()
        results[backend] = (out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(results["cpu"][0], results["ref"][0], rtol=1e-10, atol=1e-12)
    for name, grad in results["ref"][1].items():
        torch.testing.assert_close(results["cpu"][1][name], grad, rtol=1e-8, atol=1e-10, msg=name)


def published_file(path, model, extra=None):
    """A checkpoint as the published training script writes it: model, args Namespace, epoch."""
    obj = {"model": model.state_dict(), "args": argparse.Namespace(model="vim_tiny", lr=5e-4), "epoch": 299}
    obj.update(extra or {})
    torch.save(obj, path)
    return path


def test_published_checkpoint_loads_strictly_and_reproduces_logits(tmp_path):
    src = small().eval()
    path = published_file(tmp_path / "vim_t.pth", src)
    dst = small().eval()
    load_model_weights(dst, path)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_state_dict_from_ddp_module_prefix_loads(tmp_path):
    src = small()
    torch.save({"model": {f"module.{k}": v for k, v in src.state_dict().items()}}, tmp_path / "ddp.pth")
    dst = load_model_weights(small(), tmp_path / "ddp.pth")
    torch.testing.assert_close(dst.pos_embed, src.pos_embed)


def test_mismatched_checkpoint_lists_keys(tmp_path):
    src = small(depth=3)
    path = published_file(tmp_path / "deeper.pth", src)
    with pytest.raises(CheckpointError, match=r"unexpected: layers\.2\.mixer\.A_b_log"):
        load_model_weights(small(), path)
    path = published_file(tmp_path / "wider.pth", small(embed_dim=48))
    with pytest.raises(CheckpointError,
                       match=r"shape mismatch: cls_token: checkpoint \(1, 1, 48\) vs model \(1, 1, 32\)"):
        load_model_weights(small(), path)


def test_missing_file_and_garbage_file(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint file not found"):
        load_model_weights(small(), tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pth is neither a PyTorch checkpoint nor a safetensors file: it "
                                              "looks like a text file"):
        load_model_weights(small(), tmp_path / "junk.pth")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"model": {}, "payload": _RunsCode()}, path)  # the pickle calls os.system when loaded
    with pytest.raises(CheckpointError, match="refusing to load .*could run code"):
        load_model_weights(small(), path)


def test_finetune_to_other_resolution_stride_and_class_count(tmp_path):
    src = small(img_size=32)  # 2x2 grid
    path = published_file(tmp_path / "src.pth", src)
    dst = small(img_size=64, num_classes=3, stride=8)  # 7x7 grid (stride 8), new head
    head_before = dst.head.weight.clone()
    load_model_weights(dst, path)
    assert dst.pos_embed.shape == (1, 50, 32)
    # the middle class token's embedding moves to the new middle
    torch.testing.assert_close(dst.pos_embed[0, 24], src.pos_embed[0, 2])
    torch.testing.assert_close(dst.layers[1].mixer.A_log, src.layers[1].mixer.A_log)
    assert dst.head.weight.shape == (3, 32) and not torch.equal(dst.head.weight, head_before)
    dst(torch.randn(1, 3, 64, 64))


def test_resample_pos_embed_is_identity_on_same_grid_and_smooth_otherwise():
    pe = torch.randn(1, 17, 8)
    assert resample_pos_embed(pe, (4, 4), (4, 4)) is pe
    # a constant embedding stays constant under bicubic resampling
    const = torch.ones(1, 17, 8)
    torch.testing.assert_close(resample_pos_embed(const, (4, 4), (6, 6)), torch.ones(1, 37, 8))


def test_safetensors_file_loads(tmp_path):
    from safetensors.torch import save_file

    src = small().eval()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "vim.safetensors"))
    dst = load_model_weights(small().eval(), tmp_path / "vim.safetensors")
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="bad.safetensors is neither a PyTorch checkpoint nor a safetensors "
                                              "file: it looks like an unknown binary format"):
        load_model_weights(small(), tmp_path / "bad.safetensors")
