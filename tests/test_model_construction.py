"""The model a recipe trains, built as `vim-ds train` builds it, against what the published constructor builds for
the same run (issue 37, item 4).

Our side: `vim_ds.cli.run_options.parse_args(["--config", RECIPE, ...])`, then
`vim_ds.config.components.model_config(config, classes).build()` of its RunConfig, the call the trainer makes
(vim_ds/engine/parts.py). The published side (tests/published_vim.py, which imports nothing from vim_ds): the
recipe's `recipe: source:` script's options over main.py's defaults, main.py's create_model keyword arguments, the
registered function's and VisionMamba's own defaults, and from those what VisionMamba.__init__ builds
(`published_modules`, `published_shapes`, `published_flags`, `published_init`) and computes (`vim_forward`, which
models train mode's dropout and per-block drop path in the published order of random draws, and the
residual_in_fp32 / fused_add_norm flags).

Compared, module by module (path -> kind and attributes): every Linear/Conv (sizes, kernel, stride, padding,
groups, bias), every norm (type, eps), every Dropout p, every block's DropPath probability and the final one;
parameter names and shapes; the construction flags visible in the built model (middle class token, absolute
position embedding, bidirectional v2 mixer, divide-out, no layer scale, no RoPE); each parameter's initialisation
rule; a float64 forward with the same random weights in eval mode and in train mode with the RNG seeded alike (the
published model draws: pos_drop's dropout, then block i's drop path for i = 1..depth-1, then the final one: ours
draws the same numbers in the same order, so the outputs agree to rounding); and a bfloat16 forward that tells
the published residual_in_fp32=True, fused_add_norm=True apart from the other values of those flags.

Sizes: the literal recipe (depth 24, 224 px, 1000 classes) for everything but forward passes; depth 6, width 32,
32 px through `--model-kwargs depth=6 embed_dim=32 --input-size 32` (on both sides) for the forward passes, both
with the recipe's own drop/drop-path and with `--drop 0.2 --drop-path 0.3` typed after it (every block's
probability then differs, and dropout is on). Negative controls: a model misbuilt in one way at a time (the
drop-path schedule reversed, norm eps 1e-6, dropout ignored, drop path ignored, the out_proj depth scaling
missing, divide-out off, the residual in bf16, the norm reading the rounded residual) must fail the comparison that
guards it.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

import published_vim as pv  # noqa: E402

F64 = torch.float64
SMALL = dict(depth=6, embed_dim=32)
SMALL_IMG = 32
SMALL_CLASSES = 10
STOCHASTIC = dict(drop=0.2, drop_path=0.3)  # typed after the recipe on both sides
F64_TOL = 1e-10


def _recipes() -> dict:
    from vim_ds.config.shipped_configs import recipes

    return recipes()


RECIPES = sorted(_recipes())


def recipe_file(recipe: str) -> dict:
    with open(_recipes()[recipe]) as f:
        return yaml.safe_load(f)


def recipe_source(recipe: str) -> str:
    return recipe_file(recipe)["recipe"]["source"]


def ours(recipe: str, classes: int, *extra: str) -> nn.Module:
    """The model `vim-ds train --config RECIPE EXTRA...` trains, built by the trainer's own call."""
    from vim_ds.cli.run_options import parse_args
    from vim_ds.config.components import model_config
    from vim_ds.config.run_config import RunConfig

    requires = recipe_file(recipe)["recipe"].get("requires") or ()
    needs = ["--finetune", "/nonexistent.pth"] if "finetune" in requires else []  # parse_args insists on one
    args = parse_args(["--config", recipe, "--data-path", "/nonexistent", *needs, *extra])
    # what parts.build_trainer calls (--finetune weights: loaded after)
    return model_config(RunConfig.from_dict(vars(args)), classes).build()


def published_args(recipe: str, classes: int, size: dict | None = None, **options) -> dict:
    """VisionMamba.__init__'s arguments for the recipe's published script (options typed after it)."""
    opts = pv.script_options(recipe_source(recipe), **options)
    return pv.visionmamba_arguments(opts["model"], pv.main_py_create_kwargs(opts, classes), **(size or {}))


def small_extra(stochastic: bool) -> list:
    extra = ["--model-kwargs", *(f"{k}={v}" for k, v in SMALL.items()), "--input-size", str(SMALL_IMG)]
    if stochastic:
        extra += ["--drop", str(STOCHASTIC["drop"]), "--drop-path", str(STOCHASTIC["drop_path"])]
    return extra


def small_published_args(recipe: str, stochastic: bool) -> dict:
    options = dict(input_size=SMALL_IMG, **(STOCHASTIC if stochastic else {}))
    return published_args(recipe, SMALL_CLASSES, SMALL, **options)


# ------------------------------------------------------------------------------------------------------------------
# Our model, described in the published terms
# ------------------------------------------------------------------------------------------------------------------

_QUIET = (nn.Identity, nn.SiLU)  # parameterless, deterministic: the published description leaves them out


def describe(model: nn.Module) -> dict:
    """Path -> (kind, attributes) for every module of `model` that holds parameters or draws random numbers, in
    published_modules' terms; any other leaf module is listed as ("other", class name), so that something the
    published model lacks shows up."""
    from timm.layers import DropPath

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[name] = ("Linear", m.in_features, m.out_features, m.bias is not None)
        elif isinstance(m, (nn.Conv1d, nn.Conv2d)):
            out[name] = (type(m).__name__, m.in_channels, m.out_channels, tuple(m.kernel_size), tuple(m.stride),
                         tuple(m.padding), m.groups, m.bias is not None)
        elif isinstance(m, nn.Dropout):
            out[name] = ("Dropout", float(m.p))
        elif isinstance(m, DropPath):
            assert m.scale_by_keep, name  # the published DropPath(p) scales by 1 / keep
            out[name] = ("DropPath", float(m.drop_prob))
        elif isinstance(m, nn.LayerNorm):
            out[name] = ("LayerNorm", m.normalized_shape[0], float(m.eps))
        elif type(m).__name__ == "RMSNorm":
            out[name] = ("RMSNorm", m.weight.numel(), float(m.eps))
        elif isinstance(m, nn.Identity) and name.rsplit(".", 1)[-1] == "drop_path":
            out[name] = ("Identity",)
        elif not list(m.children()) and not isinstance(m, _QUIET):
            out[name] = ("other", type(m).__name__)
    return out


def observed_flags(model: nn.Module) -> dict:
    """The published construction flags that the built model shows (the others are checked by the forwards)."""
    mixers = [layer.mixer for layer in model.layers]
    params = dict(model.named_parameters())
    grid = model.patch_embed.grid_size
    return {
        "if_cls_token": "cls_token" in params,
        "use_middle_cls_token": model.token_position == grid[0] * grid[1] // 2,
        "use_double_cls_token": "cls_token_head" in params,
        "if_abs_pos_embed": "pos_embed" in params,
        "if_divide_out": all(getattr(m, "divide_out", False) for m in mixers),
        "bimamba_type": "v2" if all(hasattr(m, "conv1d_b") and hasattr(m, "A_b_log") for m in mixers) else "none",
        "init_layer_scale": None if not any(n.endswith("gamma") for n in params) else "set",
        "if_rope": any("rope" in n for n, _ in model.named_modules()),
    }


def differences(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def compare_construction(model: nn.Module, args: dict) -> dict:
    """Everything that differs between `model` and what VisionMamba(**args) builds ({} when nothing does)."""
    bad = {}
    mods = differences(describe(model), pv.published_modules(args))
    if mods:
        bad["modules"] = mods
    shapes = differences({k: tuple(v.shape) for k, v in model.state_dict().items()},
                         pv.published_shapes(pv.published_config_for(args)))
    if shapes:
        bad["parameters"] = shapes
    want = pv.published_flags(args)
    flags = differences(observed_flags(model), {k: want[k] for k in observed_flags(model)})
    if flags:
        bad["flags"] = flags
    if want["pooled_feature"] != "middle_cls_token":
        bad["pooled_feature"] = want["pooled_feature"]
    return bad


def check_init(model: nn.Module, args: dict) -> dict:
    """Parameters whose values do not follow the published init rule ({} when all do)."""
    rules = pv.published_init(args)
    params = dict(model.named_parameters())
    bad = {k: "no rule / no parameter" for k in set(rules) ^ set(params)}
    for name, rule in rules.items():
        if name not in params:
            continue
        v = params[name].detach().to(F64)
        kind = rule[0]
        if kind == "const":
            ok = bool((v == rule[1]).all())
        elif kind == "s4d_log":
            ok = torch.allclose(v, torch.log(torch.arange(1, v.shape[1] + 1, dtype=F64)).expand_as(v), rtol=1e-6,
                                atol=0)
        elif kind == "uniform":
            # within the bound, and filling it (max |v| close to it, spread as U(-b, b): std b / sqrt 3)
            b = rule[1]
            ok = (v.abs().max() <= b * (1 + 1e-6) and (v.numel() < 64 or v.abs().max() >= 0.8 * b)
                  and (v.numel() < 256 or abs(v.std() / (b / math.sqrt(3)) - 1) < 0.15))
        elif kind == "trunc_normal":
            ok = v.abs().max() <= 2.0 and (v.numel() < 256 or abs(v.std() / rule[1] - 1) < 0.15)
        elif kind == "lecun_normal":
            std = 1 / math.sqrt(rule[1])
            ok = v.abs().max() <= 2 * std / 0.87962566103423978 + 1e-9 and (
                v.numel() < 256 or abs(v.std() / std - 1) < 0.15)
        elif kind == "dt_bias":
            _, lo, hi, floor = rule
            dt = torch.nn.functional.softplus(v)
            ok = dt.min() >= max(lo, floor) * (1 - 1e-4) and dt.max() <= hi * (1 + 1e-4) and (
                v.numel() < 64 or (dt.max() > hi / 2 and dt.min() < lo * 2))  # log-uniform over [lo, hi]
        else:  # pragma: no cover
            raise KeyError(kind)
        if not ok:
            bad[name] = (rule, float(v.abs().max()), float(v.std()) if v.numel() > 1 else None)
    return bad


# ------------------------------------------------------------------------------------------------------------------
# Misbuilt models: the negative controls
# ------------------------------------------------------------------------------------------------------------------

def misbuilt(model: nn.Module, how: str) -> nn.Module:
    """A copy of `model` with one construction mistake a factory could make."""
    from timm.layers import DropPath

    m = copy.deepcopy(model)
    if how == "drop_path_reversed":       # the per-block schedule read back to front
        slots = [layer.drop_path for layer in m.layers]
        probs = [getattr(s, "drop_prob", 0.0) for s in slots][::-1]
        for layer, p in zip(m.layers, probs):
            layer.drop_path = DropPath(p) if p > 0 else nn.Identity()
    elif how == "drop_path_ignored":
        for layer in m.layers:
            layer.drop_path = nn.Identity()
        m.drop_path = nn.Identity()
    elif how == "drop_path_uniform":       # every block at the full rate (no linear decay rule)
        rate = m.drop_path.drop_prob
        for layer in m.layers[1:]:
            layer.drop_path = DropPath(rate)
    elif how == "eps_1e-6":
        for mod in m.modules():
            if type(mod).__name__ == "RMSNorm":
                mod.eps = 1e-6
    elif how == "drop_ignored":
        m.pos_drop = nn.Dropout(0.0)
    elif how == "divide_out_off":
        for layer in m.layers:
            layer.mixer.divide_out = False
    elif how == "out_proj_unscaled":       # the 1/sqrt(depth) rescale of out_proj missing
        with torch.no_grad():
            for layer in m.layers:
                layer.mixer.out_proj.weight.mul_(math.sqrt(len(m.layers)))
    else:  # pragma: no cover
        raise KeyError(how)
    return m


# ------------------------------------------------------------------------------------------------------------------
# The literal recipes
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_models():
    cache = {}

    def get(recipe):
        if recipe not in cache:
            torch.manual_seed(0)
            cache[recipe] = ours(recipe, 1000).eval()
        return cache[recipe]

    return get


def test_every_recipe_names_a_published_script():
    assert RECIPES, "no shipped recipes found"
    for recipe in RECIPES:
        source = recipe_source(recipe)
        assert source in pv.PUBLISHED_SCRIPTS or pv.DERIVED_SCRIPTS[source][0] in pv.PUBLISHED_SCRIPTS, recipe
        model = recipe_file(recipe)["model"]
        assert pv.ALIASES.get(model, model) == pv.script_options(source)["model"], recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_model_is_built_as_published(full_models, recipe):
    """The literal recipe: depth 24, 224 px, 1000 classes, the recipe's own drop and drop path."""
    model = full_models(recipe)
    args = published_args(recipe, 1000)
    assert compare_construction(model, args) == {}
    if recipe == "vim_tiny_pretrain":  # the init rules at full depth once (every recipe's at depth 6 below)
        assert check_init(model, args) == {}
    # what the recipe sets reached the model (not only "both sides agree")
    block_p, final_p = pv.stochastic_depth(args)
    d = describe(model)
    assert [d[f"layers.{i}.drop_path"][1:] or (0.0,) for i in range(24)] == [(p,) for p in block_p]
    if args["drop_path_rate"] > 0:
        assert len(set(block_p[1:] + [final_p])) == 24, "every drop-path probability differs (the schedule is checked)"
        assert d["drop_path"] == ("DropPath", final_p)


@pytest.mark.parametrize("how", ["drop_path_reversed", "drop_path_uniform"])
def test_negative_control_full_recipe(full_models, how):
    """The comparison catches a misread schedule on the one recipe with stochastic depth (vim_small_pretrain) at
    its full depth (the other misreadings are controlled at depth 6 below)."""
    recipe = "vim_small_pretrain"
    model = full_models(recipe)
    bad = compare_construction(misbuilt(model, how), published_args(recipe, 1000))
    assert set(bad) == {"modules"} and all(k.endswith("drop_path") for k in bad["modules"]), bad


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_model_init_as_published(recipe):
    """Each recipe's freshly built model (depth 6: the out_proj rescale is 1/sqrt(6)) follows the published init."""
    torch.manual_seed(2)
    model = ours(recipe, SMALL_CLASSES, *small_extra(False))
    args = small_published_args(recipe, False)
    assert check_init(model, args) == {}
    bad = check_init(misbuilt(model, "out_proj_unscaled"), args)  # negative control
    assert bad and all(k.endswith("out_proj.weight") for k in bad), bad


# ------------------------------------------------------------------------------------------------------------------
# Reduced size: forwards
# ------------------------------------------------------------------------------------------------------------------

CASES = [pytest.param(r, s, id=f"{r}-{'stochastic' if s else 'as-is'}") for r in RECIPES for s in (False, True)]


@pytest.fixture(scope="module")
def small_case():
    cache = {}

    def get(recipe, stochastic):
        key = (recipe, stochastic)
        if key not in cache:
            args = small_published_args(recipe, stochastic)
            cfg = pv.published_config_for(args)
            torch.manual_seed(1)
            model = ours(recipe, SMALL_CLASSES, *small_extra(stochastic))
            sd = pv.random_state_dict(cfg, seed=RECIPES.index(recipe))
            model = model.double()
            model.load_state_dict(sd, strict=True)
            cache[key] = (model, args, cfg, sd)
        return cache[key]

    return get


def train_spec(args: dict) -> dict:
    block_p, final_p = pv.stochastic_depth(args)
    return dict(pos_drop=float(args["drop_rate"]), block_drop_path=block_p, final_drop_path=final_p)


def forwards(model, sd, cfg, args, x, seed):
    """(ours eval, published eval, ours train, published train), train with the RNG seeded alike (ours with
    autograd recording, as the trainer runs it)."""
    with torch.no_grad():
        model.eval()
        got_eval = model(x)
        want_eval = pv.vim_forward(sd, x, cfg)
        torch.manual_seed(seed)
        want_train = pv.vim_forward(sd, x, cfg, train=train_spec(args))
    model.train()
    torch.manual_seed(seed)
    got_train = model(x).detach()
    model.eval()
    return got_eval, want_eval, got_train, want_train


def rel_err(a, b) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def images(cfg, batch=4, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g, dtype=F64)


@pytest.mark.parametrize("recipe,stochastic", CASES)
def test_reduced_recipe_model_matches_published(small_case, recipe, stochastic):
    model, args, cfg, sd = small_case(recipe, stochastic)
    assert cfg.depth == SMALL["depth"] and cfg.embed_dim == SMALL["embed_dim"] and cfg.img_size == SMALL_IMG
    assert compare_construction(model, args) == {}
    block_p, final_p = pv.stochastic_depth(args)
    if stochastic:
        # blocks 1..depth-1 and the final join each apply their own probability (block 0 has nothing to drop)
        assert len(set(block_p[1:] + [final_p])) == cfg.depth, "every drop-path probability differs"
        assert args["drop_rate"] == STOCHASTIC["drop"]
    x = images(cfg)
    got_eval, want_eval, got_train, want_train = forwards(model, sd, cfg, args, x, seed=123)
    assert want_eval.std() > 0.1
    assert rel_err(got_eval, want_eval) <= F64_TOL
    assert rel_err(got_train, want_train) <= F64_TOL
    if stochastic or args["drop_path_rate"] > 0 or args["drop_rate"] > 0:
        assert rel_err(want_train, want_eval) > 1e-3, "train mode drew no random numbers"
    else:
        assert rel_err(want_train, want_eval) == 0


@pytest.mark.parametrize("how", ["drop_path_reversed", "drop_path_uniform", "drop_path_ignored", "eps_1e-6",
                                 "drop_ignored", "divide_out_off"])
def test_negative_control_reduced(small_case, how):
    """Each misbuilt model fails the structural comparison and a forward: eps and divide-out the eval forward,
    the stochastic options the seeded train-mode forward."""
    recipe = "vim_tiny_pretrain"
    model, args, cfg, sd = small_case(recipe, True)
    wrong = misbuilt(model, how)
    assert compare_construction(wrong, args), how
    got_eval, want_eval, got_train, want_train = forwards(wrong, sd, cfg, args, images(cfg), seed=123)
    if how in ("eps_1e-6", "divide_out_off"):
        assert rel_err(got_eval, want_eval) > 100 * F64_TOL, how
    else:
        assert rel_err(got_eval, want_eval) <= F64_TOL
        assert rel_err(got_train, want_train) > 100 * F64_TOL, how


# ------------------------------------------------------------------------------------------------------------------
# residual_in_fp32 and fused_add_norm: visible only below fp32
# ------------------------------------------------------------------------------------------------------------------

def test_residual_in_fp32_and_fused_add_norm_as_published(small_case):
    """In bfloat16, with ours' own embedding and mixer outputs fed to the published add-then-norm (so that only the
    residual stream and the norms are compared): ours keep the stream in fp32 (residual_in_fp32=True: its
    intermediates equal the fp32 sums exactly, which a bf16 stream does not) and normalise the fp32 sum
    (fused_add_norm=True: the unfused norm reads the stream rounded to bf16 first, which changes many outputs)."""
    model, args, cfg, sd = small_case("vim_tiny_pretrain", False)
    flags = pv.published_flags(args)
    assert (flags["residual_in_fp32"], flags["fused_add_norm"]) == (True, True)
    bf = copy.deepcopy(model).to(torch.bfloat16).eval()
    seen = {}

    def keep(name):
        def hook(module, inputs, output):
            seen[name] = output
        return hook

    def keep_input(name):  # a block's norm output: its mixer's input (the add and the norm are one op)
        def hook(module, inputs):
            seen[name] = inputs[0]
        return hook

    handles = [bf.pos_drop.register_forward_hook(keep("embedded"))]
    for i, layer in enumerate(bf.layers):
        handles.append(layer.mixer.register_forward_hook(keep(f"mixer{i}")))
        handles.append(layer.mixer.register_forward_pre_hook(keep_input(f"norm{i}")))
    x = images(cfg, batch=4, seed=9).to(torch.bfloat16)
    with torch.no_grad():
        seen["norm_f"], streams = bf.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True)
    for h in handles:
        h.remove()
    assert all(p.dtype == torch.float32 for p, _ in streams)

    def published(residual_in_fp32, fused_add_norm):
        """(max |stream difference| over blocks, fraction of norm outputs that differ)."""
        residual, stream_err, differ, total = None, 0.0, 0, 0
        for i in range(cfg.depth + 1):
            hidden = seen["embedded"] if i == 0 else seen[f"mixer{i - 1}"]
            layer = bf.layers[i] if i < cfg.depth else None
            weight = layer.norm.weight if layer is not None else bf.norm_f.weight
            residual, normed = pv.add_rms_norm(residual, hidden, weight, cfg.eps, torch.bfloat16,
                                               residual_in_fp32, fused_add_norm)
            got = seen[f"norm{i}"] if layer is not None else seen["norm_f"]
            differ += int((normed != got).sum())
            total += got.numel()
            if i > 0:  # ours' stream after block i-1, without its class token
                patches, cls = streams[i - 1]
                ours_stream = torch.cat([patches[:, :cfg.cls_position], cls, patches[:, cfg.cls_position:]], 1)
                stream_err = max(stream_err, (ours_stream - residual.float()).abs().max().item())
        return stream_err, differ / total

    results = {(r, f): published(r, f) for r in (True, False) for f in (True, False)}
    stream_err, norm_differ = results[(True, True)]
    assert stream_err == 0.0 and norm_differ < 0.01, results
    for (r, f), (s_err, n_diff) in results.items():
        if not r:
            assert s_err > 1e-3, ("a bf16 stream goes unnoticed", results)
        if not f:
            assert n_diff > 10 * max(norm_differ, 1e-3), ("an unfused norm goes unnoticed", results)
