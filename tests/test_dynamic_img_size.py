"""Vim at any input size, the timm way (`dynamic_img_size=True`, `dynamic_img_pad=True`).

A model built at 224 px and run on an N px image must give the logits of a model built statically at N px whose
weights are the 224 px weights loaded through the checkpoint loader (position embeddings resampled bicubically, the
class token's embedding moved to the middle of the new sequence, as the published model places it). Negative
controls: nearest-neighbour resampling, or the class token's embedding left at its old index, miss by far more
than the tolerance.
"""
import pytest
import timm
import torch
import torch.nn.functional as F

import vim_ds  # noqa: F401  (registers the models)
from vim_ds.checkpoint import load_model_weights

import preloaded

ARCH = dict(depth=2, embed_dim=32, num_classes=5)
TOL = 1e-6  # float32 rounding of logits of order 0.1-1 (~30 ulps); both paths run the same ops: equal in practice


def weights_224(tmp_path, stride=16):
    """A published-format file of a 224 px model whose position embeddings matter (std 1, smooth across the grid:
    a random init's std 0.02 would make every resampling look alike)."""
    torch.manual_seed(0)
    model = timm.create_model("vim_tiny", stride=stride, **ARCH)
    grid = model.patch_embed.grid_size
    with torch.no_grad():
        coarse = torch.randn(1, ARCH["embed_dim"], 4, 4)
        smooth = F.interpolate(coarse, size=grid, mode="bilinear", align_corners=False)
        patches = smooth.flatten(2).transpose(1, 2)
        mid = model.token_position
        cls = torch.randn(1, 1, ARCH["embed_dim"]) * 2
        model.pos_embed.copy_(torch.cat((patches[:, :mid], cls, patches[:, mid:]), dim=1))
    path = tmp_path / f"vim_s{stride}_224.pth"
    torch.save({"model": model.state_dict()}, path)
    return model.eval(), path


def dynamic_from(model):
    dyn = timm.create_model("vim_tiny", stride=model.patch_embed.stride, dynamic_img_size=True, **ARCH).eval()
    dyn.load_state_dict(model.state_dict())  # strict: dynamic_img_size adds no parameter
    return dyn


def static_at(size, path, stride=16):
    static = timm.create_model("vim_tiny", stride=stride, img_size=size, **ARCH).eval()
    load_model_weights(static, path)  # checkpoint_filter_fn: bicubic resampling to the new grid
    return static


def wrong_pos_embed(pos, old_grid, new_grid, mode="bicubic", cls_index=None):
    """Resampled position embeddings with one deliberate mistake: another interpolation mode, or the class
    token's embedding placed at `cls_index` instead of the new middle."""
    mid = old_grid[0] * old_grid[1] // 2
    cls, patches = pos[:, mid:mid + 1], torch.cat((pos[:, :mid], pos[:, mid + 1:]), dim=1)
    grid = patches.reshape(1, *old_grid, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode=mode, **({} if mode == "nearest" else {"align_corners": False}))
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], -1)
    at = new_grid[0] * new_grid[1] // 2 if cls_index is None else cls_index
    return torch.cat((patches[:, :at], cls, patches[:, at:]), dim=1)


@pytest.mark.parametrize("stride,sizes", [
    (16, [160, 192, 224, 256, 288, (160, 224), (288, 192)]),
    (8, [160, 224, 256, (176, 224)]),
], ids=["stride16", "stride8"])
def test_dynamic_size_equals_the_static_model_built_at_that_size(tmp_path, stride, sizes):
    src, path = weights_224(tmp_path, stride)
    dyn = dynamic_from(src)
    torch.manual_seed(1)
    for size in sizes:
        hw = size if isinstance(size, tuple) else (size, size)
        static = static_at(hw, path, stride)
        x = torch.randn(2, 3, *hw)
        with torch.no_grad():
            got, want = dyn(x), static(x)
            torch.testing.assert_close(got, want, rtol=0, atol=TOL, msg=f"{hw}")
            if hw == (224, 224):
                torch.testing.assert_close(got, src(x), rtol=0, atol=0)
                continue
            # negative controls: each mistake moves the logits by >= 10x the tolerance
            grid, new_grid = src.patch_embed.grid_size, static.patch_embed.grid_size
            for mistake in (dict(mode="nearest"), dict(cls_index=src.token_position)):
                static.pos_embed.copy_(wrong_pos_embed(src.pos_embed, grid, new_grid, **mistake))
                miss = (static(x) - got).abs().max().item()
                assert miss >= 10 * TOL, (hw, mistake, miss)


def test_dynamic_model_forward_intermediates_follow_the_input_grid(tmp_path):
    src, path = weights_224(tmp_path)
    dyn = dynamic_from(src)
    static = static_at((160, 224), path)
    x = torch.randn(1, 3, 160, 224)
    with torch.no_grad():
        final, maps = dyn.forward_intermediates(x, indices=[0, 1], return_prefix_tokens=True)
        final_s, maps_s = static.forward_intermediates(x, indices=[0, 1], return_prefix_tokens=True)
    assert [m.shape for m, _ in maps] == [(1, 32, 10, 14)] * 2
    torch.testing.assert_close(final, final_s, rtol=0, atol=TOL)
    for (m, c), (ms, cs) in zip(maps, maps_s):
        torch.testing.assert_close(m, ms, rtol=0, atol=TOL)
        torch.testing.assert_close(c, cs, rtol=0, atol=TOL)


def test_dynamic_img_pad_pads_bottom_right_and_unpadded_odd_size_is_one_line():
    torch.manual_seed(0)
    dyn = timm.create_model("vim_tiny", dynamic_img_size=True, **ARCH).eval()
    padded = timm.create_model("vim_tiny", dynamic_img_size=True, dynamic_img_pad=True, **ARCH).eval()
    padded.load_state_dict(dyn.state_dict())
    x = torch.randn(1, 3, 200, 170)
    with torch.no_grad():
        got = padded(x)
        want = dyn(F.pad(x, (0, 6, 0, 8)))  # 200 -> 208 = 16 + 12*16 rows, 170 -> 176 columns
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got - dyn(F.interpolate(x, size=(208, 176)))).abs().max() > 10 * TOL  # not a resize
    with pytest.raises(ValueError) as err:
        dyn(x)
    message = str(err.value)
    assert "\n" not in message and "(200, 170)" in message and "dynamic_img_pad=True" in message
    # smaller than one patch: padded up to one patch
    assert padded(torch.randn(1, 3, 10, 20)).shape == (1, 5)


def test_static_model_still_refuses_another_size():
    model = timm.create_model("vim_tiny", **ARCH)
    with pytest.raises(ValueError, match=r"input images are \(160, 160\), the model was built for \(224, 224\)"):
        model(torch.randn(1, 3, 160, 160))


def test_dynamic_size_trains_the_224_position_embeddings():
    torch.manual_seed(0)
    dyn = timm.create_model("vim_tiny", dynamic_img_size=True, drop_path_rate=0.0, **ARCH)
    dyn(torch.randn(2, 3, 160, 192)).sum().backward()
    assert dyn.pos_embed.grad.shape == (1, 197, 32) and dyn.pos_embed.grad.abs().sum() > 0
    assert torch.isfinite(dyn.pos_embed.grad).all()


def test_torch_compile_fullgraph_of_a_dynamic_model(tmp_path):
    src, path = weights_224(tmp_path)
    dyn = dynamic_from(src)
    compiled = torch.compile(dyn, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for hw in [(160, 160), (192, 224)]:
            x = torch.randn(2, 3, *hw)
            torch.testing.assert_close(compiled(x), static_at(hw, path)(x), rtol=0, atol=TOL)


def test_timm_validate_py_flow_with_img_size_and_a_224_checkpoint(tmp_path):
    """What timm's validate.py does with `--img-size 160 --checkpoint FILE --model-kwargs dynamic_img_size=True`:
    resolve_model_input_args -> create_model -> load_checkpoint (a plain load_state_dict of the 224 px file) ->
    resolve_input_data_config -> transform -> forward. timm builds a fixed-size model at 160 px; the dynamic model
    resamples the loaded position embeddings, so it scores what the static 160 px model loaded through the
    checkpoint filter scores. Without dynamic_img_size the file's 224 px table is timm's size-mismatch error."""
    from PIL import Image
    from timm.data import create_transform, resolve_input_data_config
    from timm.models import load_checkpoint, resolve_model_input_args

    src, path = weights_224(tmp_path)
    timm_file = tmp_path / "timm_checkpoint.pth"
    torch.save({"state_dict": src.state_dict()}, timm_file)
    image = Image.new("RGB", (300, 200), (120, 30, 200))
    for extra in (dict(dynamic_img_size=True), dict(dynamic_img_size=True, img_size=224), {}):
        args = dict(img_size=160, model_kwargs={**dict(depth=2, embed_dim=32), **extra})
        model = timm.create_model(**resolve_model_input_args("vim_tiny", args, pretrained=False, num_classes=5,
                                                             **args["model_kwargs"]))
        if not extra:
            with pytest.raises(RuntimeError, match="size mismatch for pos_embed"):
                load_checkpoint(model, str(timm_file))
            continue
        load_checkpoint(model, str(timm_file))
        cfg = resolve_input_data_config(model.eval(), args, use_test_size=True)
        assert cfg["input_size"] == (3, 160, 160)
        x = create_transform(**cfg)(image)[None]
        with torch.no_grad():
            torch.testing.assert_close(model(x), static_at(160, path)(x), rtol=0, atol=TOL, msg=str(extra))


def test_vim_ds_eval_scores_a_32px_checkpoint_at_48px(tmp_path, digits):
    """`vim-ds eval --input-size 48` on weights saved at 32 px: the model is built at 48 px and the weights'
    position embeddings are resampled on load, so it scores what the static resampled model scores in-process;
    the same with --model-kwargs dynamic_img_size=True. Negative control: nearest-neighbour resampled weights
    score another loss."""
    import json
    import sys

    from vim_ds.data import build_dataset
    from vim_ds.config.components import dataset_config
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    arch = dict(depth=2, embed_dim=32, patch_size=4, stride=4)
    torch.manual_seed(0)
    src = timm.create_model("vim_tiny", num_classes=10, img_size=32, **arch)
    with torch.no_grad():  # positions and a head that matter (a fresh init's logits are all about 0)
        src.pos_embed.normal_(0, 1)
        src.head.weight.normal_(0, 1)
    path = tmp_path / "w32.pth"
    torch.save({"model": src.state_dict()}, path)
    argv = ["--data-set", "folder", "--data-path", digits, "--num_workers", "0", "--model", "vim_tiny",
            "--input-size", "48", "--precision", "fp32", "--batch-size", "64", "--resume", str(path),
            "--model-kwargs", *[f"{k}={v}" for k, v in arch.items()]]

    records = []
    for extra in ([], ["dynamic_img_size=True"]):
        out = tmp_path / f"eval{len(records)}"
        proc = preloaded.run([sys.executable, "-m", "vim_ds.eval", *argv, *extra, "--output_dir", str(out)],
                             capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]))

    config = RunConfig.from_dict(vars(parse_args(argv + ["--eval"], prog="vim-ds eval")))
    val, _ = build_dataset(dataset_config(config), is_train=False)
    images = torch.stack([val[i][0] for i in range(len(val))])
    targets = torch.tensor([val[i][1] for i in range(len(val))])

    def score(model):
        with torch.no_grad():
            logits = torch.cat([model.eval()(images[i:i + 96]) for i in range(0, len(images), 96)])
        hits = (logits.argmax(1) == targets).sum().item()
        return 100.0 * hits / len(targets), F.cross_entropy(logits.double(), targets).item()

    static = timm.create_model("vim_tiny", num_classes=10, img_size=48, **arch)
    load_model_weights(static, path)
    acc1, loss = score(static)
    for record in records:
        assert record["eval_images"] == 360
        assert record["eval_acc1"] == pytest.approx(acc1, abs=1e-9)
        assert record["eval_loss"] == pytest.approx(loss, rel=1e-6)
    with torch.no_grad():
        static.pos_embed.copy_(wrong_pos_embed(src.pos_embed, (8, 8), (12, 12), mode="nearest"))
    _, wrong_loss = score(static)
    assert abs(wrong_loss - loss) > 10 * 1e-6 * loss, (wrong_loss, loss)


def test_fx_feature_extractor_of_a_dynamic_model_runs_at_any_size(tmp_path):
    """One fx trace (timm's create_feature_extractor) serves every size: the grid is read on the traced tensors."""
    from timm.models import create_feature_extractor

    src, path = weights_224(tmp_path)
    extractor = create_feature_extractor(dynamic_from(src), ["layers.1", "head"])
    with torch.no_grad():
        for hw in [(160, 160), (192, 256)]:
            x = torch.randn(1, 3, *hw)
            out = extractor(x)
            torch.testing.assert_close(out["head"], static_at(hw, path)(x), rtol=0, atol=TOL)
