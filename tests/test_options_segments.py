"""A run resumed with other options keeps a true record (issue 36, item 5): options.yaml used to be rewritten with
the resumed run's options, so `compare-runs` reported the first steps as run at the new lr and `--config
OUTPUT_DIR/options.yaml` no longer repeated the run. Now the resume says which options changed, in one note, and
options.yaml keeps the options the run started with and appends a segment (from which step, what changed);
compare-runs names it; --config repeats the first segment and says what it does not repeat. Real runs (one rank,
synthetic images), real files."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from train_utils import QUIET_AUG, ROOT, TINY, config, records, run_train


def args(out, ds_config, *extra) -> list:
    return ["--data-set", "synthetic", "--synthetic-size", 32, "--nb-classes", 4, *TINY, *QUIET_AUG,
            "--num_workers", 0, "--deepspeed_config", ds_config, "--precision", "fp32", "--batch-size", 4,
            "--lr", 2e-3, "--unscale-lr", "--warmup-epochs", 0, "--no-model-ema", "--save-interval", 3,
            "--output_dir", out, *extra]


def test_a_resume_with_another_lr_is_noted_and_recorded_as_a_segment(tmp_path, capsys):
    changed, same = tmp_path / "changed", tmp_path / "same"
    # zero0 with a clipping of its own (issue 50, item 7): the run records the 0.5 that runs, and a resume with
    # the same JSON and options agrees with that record (the control below leaves the file as it is)
    clipped = tmp_path / "clipped.json"
    clipped.write_text(json.dumps({**json.loads(open(config("zero0")).read()), "gradient_clipping": 0.5}))

    def args(out, *extra):
        return globals()["args"](out, clipped, *extra)

    proc = run_train(args(changed, "--max-steps", 3))
    shutil.copytree(changed, same)
    first_record = (changed / "options.yaml").read_text()
    assert yaml.safe_load(first_record)["clip_grad"] == 0.5
    # the metrics header's command, typed with relative paths maybe, says where it ran (issue 50, item 6)
    assert records(changed)[0]["cwd"] == ROOT
    assert (f"note: {clipped} sets --clip-grad 0.5 (not given on the command line): the file's values run, and "
            f"options.yaml records them") in proc.stdout, proc.stdout[-2000:]

    proc = run_train(args(changed, "--max-steps", 5, "--lr", 0.05, "--resume", "auto"))
    note = (f"note: resuming with options that differ from {changed}/options.yaml: --max-steps 5 (was 3), --lr 0.05 "
            f"(was 0.002); recorded there as a segment from step 3; the lr schedule is rebuilt from the new values")
    assert note in proc.stdout, proc.stdout[-3000:]
    recorded = yaml.safe_load((changed / "options.yaml").read_text())
    assert (recorded["lr"], recorded["max_steps"]) == (0.002, 3)  # the first segment, as it ran
    assert recorded["segments"] == [{"from_step": 3, "options": {"max_steps": 5, "lr": 0.05}}]

    # the control: a resume with the same options (but what does not change the run: --resume, --log-interval)
    proc = run_train(args(same, "--max-steps", 3, "--resume", "auto", "--log-interval", 2))
    assert "resuming with options that differ" not in proc.stdout
    assert (same / "options.yaml").read_text() == first_record

    # compare-runs: the options each run started with agree; the later segment is named with its step
    from vim_ds.cli.compare_runs import main as compare_runs

    capsys.readouterr()
    assert compare_runs([str(same), str(changed)]) == 0
    out = capsys.readouterr().out
    assert ("warning: changed was resumed with other options (from step 3: --max-steps 5 (was 3), --lr 0.05 (was "
            "0.002)); `options that differ` compares the options each run started with") in out, out
    assert "  options that differ:" not in out, out  # the first segments agree (the issue: "--lr 0.05 vs 0.002")

    # --config of it repeats the first segment, and says what it does not repeat
    from vim_ds.cli.run_options import parse_args

    again = parse_args(["--config", str(changed / "options.yaml"), "--output_dir", str(tmp_path / "again")])
    assert (again.lr, again.max_steps) == (0.002, 3)
    assert (f"note: --config {changed}/options.yaml records a run whose options changed during it (from step 3: "
            f"--max-steps 5 (was 3), --lr 0.05 (was 0.002)); this run repeats its first segment") \
        in capsys.readouterr().out


# -- issue 50: a record that replays from anywhere, and a resume that notes only what changed ------------------------

def _record(argv) -> dict:
    from vim_ds.config import options_file
    from vim_ds.config.run_config import RunConfig
    from vim_ds.cli.run_options import parse_args

    return options_file.record(RunConfig.from_dict(vars(parse_args([str(a) for a in argv]))))


def test_the_record_names_the_same_files_from_another_working_directory(tmp_path, monkeypatch):
    """Item 6: options.yaml recorded the paths as typed, so `--config OUT/options.yaml` from another working
    directory trained on another --data-path with another DeepSpeed config. The paths are recorded absolute; a
    shipped config's name (the same file from anywhere) and `--resume auto` stay as they are."""
    from vim_ds.config import options_file
    from vim_ds.cli.run_options import parse_args

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for folder in (here / "data", here / "runs" / "a" / "checkpoints" / "global_step3", elsewhere / "data"):
        folder.mkdir(parents=True)
    (here / "mine.json").write_text(open(config("zero0")).read())
    (here / "w.pth").write_bytes(b"")
    monkeypatch.chdir(here)
    record = _record(["--data-path", "data", "--deepspeed_config", "mine.json", "--init-weights", "w.pth",
                      "--save-init-weights", "", "--resume", "runs/a/checkpoints/global_step3", "--output_dir",
                      "runs/b"])
    options_file.write(str(here / "runs" / "options.yaml"), record)
    monkeypatch.chdir(elsewhere)  # which has a data/ of its own: the record must not read that one
    again = parse_args(["--config", str(here / "runs" / "options.yaml")])
    assert (again.data_path, again.deepspeed_config, again.init_weights, again.resume, again.output_dir) == (
        str(here / "data"), str(here / "mine.json"), str(here / "w.pth"),
        str(here / "runs" / "a" / "checkpoints" / "global_step3"), str(here / "runs" / "b"))
    # the variants that stay: a shipped config's name, --resume auto, what was not given
    shipped = _record(["--deepspeed_config", "zero0", "--resume", "auto", "--output_dir", "x"])
    assert (shipped["deepspeed_config"], shipped["resume"], shipped["finetune"]) == ("zero0", "auto", "")


@pytest.mark.parametrize("case", ["shipped name for its path", "relative path for its absolute one"])
def test_a_resume_with_the_same_files_spelt_otherwise_is_not_a_new_segment(tmp_path, monkeypatch, case):
    """Item 16c: a run recorded with a shipped config's path (older vim_ds resolved the name first) and resumed with
    its name noted `--deepspeed_config zero0 (was .../zero0.json)` and appended a segment. The values are compared
    by what they resolve to; the variant: an older record's relative --data-path and today's absolute one. The
    control: an option that did change is a segment."""
    from vim_ds.config import options_file, shipped_configs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    common = ["--output_dir", "out", "--deepspeed_config", "zero0", "--data-path", "data"]
    recorded = _record(common)
    if case == "shipped name for its path":
        recorded["deepspeed_config"] = shipped_configs.resolve("zero0")
    else:
        recorded["data_path"] = "data"
    path = tmp_path / "options.yaml"
    options_file.write(str(path), recorded)
    text = path.read_text()
    assert options_file.write_run(str(path), _record(common + ["--resume", "auto"]), step=3) is None
    assert path.read_text() == text
    note = options_file.write_run(str(path), _record(common + ["--resume", "auto", "--lr", "0.01"]), step=3)
    assert note.startswith(f"note: resuming with options that differ from {path}: --lr 0.01 (was 0.0005); ")
