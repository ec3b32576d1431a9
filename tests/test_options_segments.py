"""A run resumed with other options keeps a true record (issue 36, item 5): options.yaml used to be rewritten with
the resumed run's options, so `compare-runs` reported the first steps as run at the new lr and `--config
OUTPUT_DIR/options.yaml` no longer repeated the run. Now the resume says which options changed, in one note, and
options.yaml keeps the options the run started with and appends a segment (from which step, what changed);
compare-runs names it; --config repeats the first segment and says what it does not repeat. Real runs (one rank,
synthetic images), real files."""
from __future__ import annotations

import shutil

import yaml

from train_utils import QUIET_AUG, TINY, config, run_train


def args(out, *extra) -> list:
    return ["--data-set", "synthetic", "--synthetic-size", 32, "--nb-classes", 4, *TINY, *QUIET_AUG,
            "--num_workers", 0, "--deepspeed_config", config("zero0"), "--precision", "fp32", "--batch-size", 4,
            "--lr", 2e-3, "--unscale-lr", "--warmup-epochs", 0, "--no-model-ema", "--save-interval", 3,
            "--output_dir", out, *extra]


def test_a_resume_with_another_lr_is_noted_and_recorded_as_a_segment(tmp_path, capsys):
    changed, same = tmp_path / "changed", tmp_path / "same"
    run_train(args(changed, "--max-steps", 3))
    shutil.copytree(changed, same)
    first_record = (changed / "options.yaml").read_text()

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
    from vim_ds.compare_runs import main as compare_runs

    capsys.readouterr()
    assert compare_runs([str(same), str(changed)]) == 0
    out = capsys.readouterr().out
    assert ("warning: changed was resumed with other options (from step 3: --max-steps 5 (was 3), --lr 0.05 (was "
            "0.002)); `options that differ` compares the options each run started with") in out, out
    assert "  options that differ:" not in out, out  # the first segments agree (the issue: "--lr 0.05 vs 0.002")

    # --config of it repeats the first segment, and says what it does not repeat
    from vim_ds.engine.run_options import parse_args

    again = parse_args(["--config", str(changed / "options.yaml"), "--output_dir", str(tmp_path / "again")])
    assert (again.lr, again.max_steps) == (0.002, 3)
    assert (f"note: --config {changed}/options.yaml records a run whose options changed during it (from step 3: "
            f"--max-steps 5 (was 3), --lr 0.05 (was 0.002)); this run repeats its first segment") \
        in capsys.readouterr().out
