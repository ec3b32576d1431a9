"""The published Vim runs as recipes (`vim-ds train --config NAME`, ds_configs/recipes/), option files of one's
own, and the options.yaml every run records (issue 28, item 2).

The official values below are read from hustvl/Vim (commit dd0358ad1e42701f22afbefa0717cc8825cf9f45): each
script's one command line (line 5 of vim/scripts/*.sh) and, for what a script does not pass, vim/main.py's
argparse defaults. There is no published Vim-base script, so there is no Vim-base recipe. A recipe of vim_ds's own
(DERIVED: the high-resolution finetuning with sequence parallelism, which nobody publishes) is a published one with
only the changes it names.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import yaml

import preloaded
from train_utils import QUIET_AUG, ROOT, TINY, step_losses, train_command, train_env

RECIPES = os.path.join(ROOT, "ds_configs", "recipes")

# hustvl/Vim vim/main.py: the defaults the scripts rely on (line of each argparse default)
MAIN_PY_DEFAULTS = {
    "epochs": 300,                      # main.py:39  --epochs default=300
    "drop": 0.0,                        # main.py:48  --drop default=0.0
    "drop_path": 0.1,                   # main.py:50  --drop-path default=0.1
    "model_ema": True,                  # main.py:55  set_defaults(model_ema=True)
    "model_ema_decay": 0.99996,         # main.py:56
    "opt_eps": 1e-8,                    # main.py:62
    "opt_betas": (0.9, 0.999),          # main.py:64  default None: timm's AdamW keeps torch's (0.9, 0.999)
    "clip_grad": None,                  # main.py:66
    "weight_decay": 0.05,               # main.py:70
    "lr": 5e-4,                         # main.py:75
    "warmup_lr": 1e-6,                  # main.py:83
    "min_lr": 1e-5,                     # main.py:85
    "warmup_epochs": 5,                 # main.py:90
    "color_jitter": 0.3,                # main.py:100
    "aa": "rand-m9-mstd0.5-inc1",       # main.py:102
    "smoothing": 0.1,                   # main.py:105
    "repeated_aug": True,               # main.py:111 set_defaults(repeated_aug=True)
    "reprob": 0.25,                     # main.py:122
    "mixup": 0.8,                       # main.py:132
    "cutmix": 1.0,                      # main.py:134
    "seed": 0,                          # main.py:173
    "input_size": 224,                  # main.py:46
    "if_amp": False,                    # main.py:196 set_defaults(if_amp=False)
    "unscale_lr": False,                # main.py:41  (main.py:388-390: lr * batch_size * world_size / 512)
    "finetune": "",                     # main.py:157
}
_T = "vim_tiny_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"
_S = "vim_small_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"
_T8 = "vim_tiny_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"
_S8 = "vim_small_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"
# recipe -> (source, what the script passes); nproc_per_node is torch.distributed.launch's
OFFICIAL = {
    "vim_tiny_pretrain": ("hustvl/Vim vim/scripts/pt-vim-t.sh line 5", dict(
        nproc_per_node=8, model=_T, batch_size=128, drop_path=0.0, weight_decay=0.1, if_amp=False)),
    "vim_small_pretrain": ("hustvl/Vim vim/scripts/pt-vim-s.sh line 5", dict(
        nproc_per_node=8, model=_S, batch_size=64, drop_path=0.05, weight_decay=0.05, lr=1e-3, if_amp=False)),
    "vim_tiny_s8_finetune": ("hustvl/Vim vim/scripts/ft-vim-t.sh line 5", dict(
        nproc_per_node=8, model=_T8, batch_size=128, lr=5e-6, min_lr=1e-5, warmup_lr=1e-5, drop_path=0.0,
        weight_decay=1e-8, epochs=30, finetune="<path_to_pt_ckpt>", if_amp=False)),
    "vim_small_s8_finetune": ("hustvl/Vim vim/scripts/ft-vim-s.sh line 5", dict(
        nproc_per_node=8, model=_S8, batch_size=128, lr=5e-6, min_lr=1e-5, warmup_lr=1e-5, drop_path=0.0,
        weight_decay=1e-8, epochs=30, finetune="<path_to_pt_ckpt>", if_amp=False)),
}
# recipe -> (the published recipe it derives from, the only values it changes, in official_effective's terms)
DERIVED = {
    "vim_tiny_1024_finetune": ("vim_tiny_s8_finetune", dict(model=_T, input_size=1024, sequence_parallel=2,
                                                            batch_size=32)),
}
COMPARED = ("min_lr", "warmup_lr", "warmup_epochs", "epochs", "weight_decay", "drop_path", "drop", "smoothing",
            "mixup", "cutmix", "reprob", "color_jitter", "aa", "model_ema", "model_ema_decay", "repeated_aug",
            "input_size", "clip_grad", "opt_eps", "opt_betas", "seed")


def official_effective(script: dict) -> dict:
    o = {**MAIN_PY_DEFAULTS, **script}
    gpus = o["nproc_per_node"]
    lr = o["lr"] if o["unscale_lr"] else o["lr"] * o["batch_size"] * gpus / 512.0  # main.py:388-390
    return {"model": o["model"], "gpus": gpus, "sequence_parallel": 1, "batch_size": o["batch_size"], "lr": lr,
            "precision": "autocast" if o["if_amp"] else "fp32", "starts_from_checkpoint": bool(o["finetune"]),
            **{k: tuple(o[k]) if isinstance(o[k], (list, tuple)) else o[k] for k in COMPARED}}


def recipe_effective(path: str) -> dict:
    """What `vim-ds train --config path` runs at the recipe's documented GPU count, in the same terms."""
    from vim_ds.config import options_file
    from vim_ds.engine.optim import scaled_lr
    from vim_ds.models import ALIASES
    from vim_ds.cli.run_options import parse_args

    _, meta = options_file.load(path)
    requires = meta.get("requires") or []
    args = parse_args(["--config", path] + (["--finetune", "pretrained.pth"] if "finetune" in requires else []))
    gpus = meta.get("gpus") or 1  # a file without `recipe:` documents no GPU count: one
    # per GPU, or with --sequence-parallel N per group of N GPUs (each holding a share of every image's tokens)
    per_gpu = args.batch_size * (args.accum_steps or 1)
    groups = gpus // args.sequence_parallel
    return {"model": ALIASES.get(args.model, args.model), "gpus": gpus, "sequence_parallel": args.sequence_parallel,
            "batch_size": per_gpu, "lr": scaled_lr(args.lr, per_gpu * groups, args.unscale_lr),
            "precision": args.precision,
            "starts_from_checkpoint": "finetune" in requires,
            **{k: tuple(getattr(args, k)) if isinstance(getattr(args, k), (list, tuple)) else getattr(args, k)
               for k in COMPARED}}


def mismatches(path: str, script: dict, changes: dict | None = None) -> list[str]:
    """What `path` runs that `script` does not; with `changes`, the published script with those values changed."""
    ours, theirs = recipe_effective(path), {**official_effective(script), **(changes or {})}
    out = []
    for key, value in theirs.items():
        mine = ours[key]
        same = (math.isclose(mine, value, rel_tol=1e-9, abs_tol=0) if isinstance(value, float) and
                isinstance(mine, (int, float)) and not isinstance(mine, bool) else mine == value)
        if not same:
            out.append(f"{key}: recipe {mine!r}, official {value!r}")
    return out


def test_the_shipped_recipes_are_the_published_scripts():
    from vim_ds.config.shipped_configs import recipes

    assert sorted(recipes()) == sorted({**OFFICIAL, **DERIVED})


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_each_recipe_of_our_own_is_a_published_one_with_only_the_changes_it_names(name):
    """The high-resolution finetuning: ft-vim-t.sh's effective lr (1e-5 at 4 groups x 32), schedule,
    regularisation and fp32, with the stride-16 model at 1024 and the split over 2 GPUs."""
    base, changes = DERIVED[name]
    assert mismatches(os.path.join(RECIPES, f"{name}.yaml"), OFFICIAL[base][1], changes) == [], name


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_each_recipe_runs_the_official_arguments(name):
    """Model, per-GPU batch at the script's 8 GPUs, the effective (scaled) lr, schedule, regularisation, fp32,
    and the finetune recipes' need of a checkpoint equal the script's + main.py's."""
    source, script = OFFICIAL[name]
    assert mismatches(os.path.join(RECIPES, f"{name}.yaml"), script) == [], source


MUTATIONS = [  # (recipe, key, new value or None to delete it, the compared key that must differ)
    ("vim_small_pretrain", "lr", 2e-3, "lr"),
    ("vim_tiny_pretrain", "lr", 1e-3, "lr"),  # the lr as the script's effective one: scaled twice
    ("vim_tiny_pretrain", "weight_decay", 0.05, "weight_decay"),
    ("vim_tiny_pretrain", "drop_path", None, "drop_path"),  # falls back to the DeiT default 0.1
    ("vim_small_pretrain", "precision", "bf16", "precision"),
    ("vim_tiny_pretrain", "unscale_lr", True, "lr"),  # (vim_small_pretrain: 8 x 64 = 512, scaling is 1)
    ("vim_tiny_s8_finetune", "min_lr", 1e-6, "min_lr"),
    ("vim_tiny_s8_finetune", "epochs", 300, "epochs"),
    ("vim_small_s8_finetune", "batch_size", 64, "batch_size"),
    ("vim_small_s8_finetune", "model", "vim_small", "model"),
    ("vim_small_s8_finetune", "recipe", None, "starts_from_checkpoint"),
    ("vim_tiny_s8_finetune", "warmup_lr", 1e-6, "warmup_lr"),
    # the split ignored in the lr's global batch would double the effective lr
    ("vim_tiny_1024_finetune", "sequence_parallel", 1, "lr"),
    ("vim_tiny_1024_finetune", "input_size", 224, "input_size"),
    ("vim_tiny_1024_finetune", "lr", 5e-6, "lr"),  # ft-vim-t.sh's --lr as it stands: 1/8 of its effective lr
]


@pytest.mark.parametrize("name,key,value,caught", MUTATIONS, ids=[f"{m[0]}-{m[1]}" for m in MUTATIONS])
def test_a_one_value_mutation_fails_the_official_arguments(tmp_path, name, key, value, caught):
    """The negative controls of the test above: one value changed (or removed) in a copy of a recipe."""
    with open(os.path.join(RECIPES, f"{name}.yaml")) as f:
        data = yaml.safe_load(f)
    if value is None:
        data.pop(key)
    else:
        data[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    base, changes = DERIVED.get(name, (name, None))
    found = mismatches(str(path), OFFICIAL[base][1], changes)
    assert [m.split(":")[0] for m in found] and caught in [m.split(":")[0] for m in found], found


def test_the_command_line_wins_over_the_file(tmp_path):
    from vim_ds.cli.run_options import parse_args

    args = parse_args(["--config", "vim_small_pretrain", "--lr", "2e-3", "--no-model-ema", "--batch-size", "8"])
    assert (args.lr, args.model_ema, args.batch_size, args.model, args.drop_path) == (2e-3, False, 8, "vim_small", 0.05)
    # YAML 1.1 reads 1e-3 as a string: the option's type makes it the number; dashed keys are the same option
    path = tmp_path / "mine.yaml"
    path.write_text("lr: 1e-3\ndrop-path: 0.2\nmodel_kwargs: {depth: 2}\nopt_betas: [0.8, 0.9]\n")
    args = parse_args(["--config", str(path)])
    assert (args.lr, args.drop_path, args.model_kwargs, list(args.opt_betas)) == (1e-3, 0.2, {"depth": 2}, [0.8, 0.9])
    assert parse_args([]).lr == 5e-4  # the parser's defaults are untouched by an earlier --config


BAD = [
    ("unknown key", "lr: 1e-3\ndrop_pth: 0.1\n", [], "unknown option 'drop_pth' (did you mean --drop-path"),
    ("bad value", "lr: fast\n", [], "lr: 'fast' is not a valid value"),
    ("bad choice", "precision: fp8\n", [], "precision: 'fp8' is not one of bf16, fp16, fp32, autocast-bf16"),
    ("wrong count", "opt_betas: [0.9]\n", [], "opt_betas: expected 2 values, got 1"),
    ("a flag", "model_ema: 1\n", [], "model_ema: expected true or false"),
    ("not a mapping", "- lr\n", [], "expected a mapping of option names to values, got a list"),
    ("not YAML", "lr: [1\n", [], "not valid YAML"),
    ("no such recipe", None, ["--config", "vim_huge_pretrain"], "neither a file nor a shipped recipe name"),
    ("finetune without checkpoint", None, ["--config", "vim_tiny_s8_finetune"],
     "this recipe starts from a checkpoint: give --finetune FILE"),
    ("out of range", "lr: -1\n", [], "--lr must be > 0"),
]


@pytest.mark.parametrize("case,text,argv,words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, case, text, argv, words):
    if text is not None:
        (tmp_path / "bad.yaml").write_text(text)
        argv = ["--config", str(tmp_path / "bad.yaml")]
    proc = preloaded.run([sys.executable, "-m", "vim_ds.train", *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("vim-ds train: error: ") and words in errors[0], errors


@pytest.mark.parametrize("text,words", [
    # issue 50, item 8: the second value won without a word
    ("batch_size: 16\nlr: 1e-3\nbatch_size: 4\n", "'batch_size' is given twice (lines 1 and 3); keep one"),
    # the variant: a key given twice in a mapping inside the file
    ("model_kwargs:\n  depth: 2\n  embed_dim: 32\n  depth: 4\n", "'depth' is given twice (lines 2 and 4); keep one"),
    # and the one spelt two ways (refused before)
    ("batch_size: 16\nbatch-size: 4\n", "'batch-size' is given twice"),
], ids=["top level", "nested", "two spellings"])
def test_a_key_given_twice_is_refused_in_one_line(tmp_path, capsys, text, words):
    from vim_ds.cli.run_options import parse_args

    (tmp_path / "twice.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(tmp_path / "twice.yaml")])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and errors[-1] == f"vim-ds train: error: --config {tmp_path / 'twice.yaml'}: {words}"


def test_configs_lists_the_recipes():
    proc = preloaded.run([sys.executable, "-m", "vim_ds.cli", "configs"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  vim_")}
    assert sorted(lines) == sorted({**OFFICIAL, **DERIVED})
    assert "vim_small, pretrain: 8 GPUs x 64 = global batch 512, lr 0.001 (--lr 0.001 per 512), 300 epochs, " \
           "zero0 fp32; from hustvl/Vim vim/scripts/pt-vim-s.sh" in lines["vim_small_pretrain"]
    assert "vim_tiny_s8, finetune: 8 GPUs x 128 = global batch 1024, lr 1e-05 (--lr 5e-06 per 512), 30 epochs" \
        in lines["vim_tiny_s8_finetune"]
    assert "vim_tiny, finetune: 8 GPUs = 4 groups of 2 x 32 = global batch 128, lr 1e-05 (--lr 4e-05 per 512)" \
        in lines["vim_tiny_1024_finetune"]


# -- options.yaml: a run recorded, started again, compared ------------------------------------------------------

def _tiny(out, *extra):
    return ["--data-set", "synthetic", "--synthetic-size", "24", "--nb-classes", "4", *TINY, *QUIET_AUG,
            "--batch-size", "4", "--max-steps", "3", "--num_workers", "0", "--deepspeed_config", "zero0",
            "--precision", "fp32", "--no-model-ema", "--warmup-epochs", "0", "--lr", "2e-3", "--unscale-lr",
            "--seed", "5", "--output_dir", str(out), *extra]


@pytest.mark.slow
def test_a_run_started_from_its_options_yaml_repeats_it_and_compare_runs_names_what_differs(tmp_path, capsys):
    """1 process, fp32, 3 steps on synthetic images: the original writes options.yaml; `--config` of it (with
    another --output_dir) has the same effective options and the same per-step losses; the negative control
    (the same file with --lr 4e-3) has other losses, and compare-runs names --lr as the option that differs."""
    from vim_ds.cli import compare_runs
    from vim_ds.config import options_file
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    first, again, other = tmp_path / "first", tmp_path / "again", tmp_path / "other_lr"
    one_thread = train_env({"OMP_NUM_THREADS": "1"})  # the same in all three runs: the losses are compared exactly
    proc = preloaded.run(train_command(_tiny(first)), capture_output=True, text=True, env=one_thread, cwd=ROOT,
                         timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recorded = first / "options.yaml"
    assert recorded.is_file()
    saved = yaml.safe_load(recorded.read_text())
    assert (saved["lr"], saved["seed"], saved["deepspeed_config"], saved["model_kwargs"]) == \
        (2e-3, 5, "zero0", {"depth": 2, "embed_dim": 32, "patch_size": 4, "stride": 4})

    original = options_file.record(RunConfig.from_dict(vars(parse_args(_tiny(first)))))
    restart = ["--config", str(recorded), "--output_dir", str(again)]
    restarted = options_file.record(RunConfig.from_dict(vars(parse_args(restart))))
    assert {**restarted, "output_dir": None} == {**original, "output_dir": None}

    # side by side, one OpenMP thread each (two processes spinning two threads each on 2 cores waste much of them)
    procs = [preloaded.popen(train_command(["--config", str(recorded), "--output_dir", str(out), *extra]),
                             env=one_thread, cwd=ROOT)
             for out, extra in ((again, []), (other, ["--lr", "4e-3"]))]
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
    losses = step_losses(first)
    assert sorted(losses) == [1, 2, 3] and step_losses(again) == losses  # fp32, one process: the same numbers
    assert step_losses(other)[3] != losses[3]  # the control trains otherwise

    code = compare_runs.main([str(first), str(again), str(other), "--tolerance", "1e-6"])
    out = capsys.readouterr().out
    assert code == 1 and out.strip().endswith("1 of 2 run(s) differ from first beyond 1e-06: other_lr"), out
    lines = [line.strip() for line in out.splitlines() if "options that differ" in line]
    assert lines == ["options that differ: --lr 0.002 (reference) vs 0.004 (other_lr)"], out
    print(out)


def _metrics(directory, losses, options=None):
    directory.mkdir()
    with open(directory / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"header": True, "global_batch": 16}) + "\n")
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3}) + "\n")
    if options is not None:
        options_file_write(directory / "options.yaml", options)
    return directory


def options_file_write(path, options):
    from vim_ds.config.options_file import write

    write(str(path), options)


def test_compare_runs_names_the_options_that_differ(tmp_path, capsys):
    from vim_ds.cli import compare_runs

    base = {"model": "vim_tiny", "lr": 2e-3, "seed": 0, "opt_betas": [0.9, 0.999], "output_dir": "a"}
    ref = _metrics(tmp_path / "ref", [2.0, 1.9], base)
    run = _metrics(tmp_path / "run", [2.0, 1.9], {**base, "lr": 1e-3, "opt_betas": [0.8, 0.999], "output_dir": "b"})
    same = _metrics(tmp_path / "same", [2.0, 1.9], {**base, "output_dir": "c"})
    old = _metrics(tmp_path / "old", [2.0, 1.9])
    assert compare_runs.main([str(ref), str(run), str(same), str(old)]) == 0
    out = capsys.readouterr().out
    assert "options that differ: --lr 0.002 (reference) vs 0.001 (run); --opt-betas 0.9 0.999 (reference) vs " \
           "0.8 0.999 (run)" in out, out
    assert out.count("options that differ") == 1, out  # same options (--output_dir aside): nothing named
    assert "warning: no options.yaml in old" in out, out
