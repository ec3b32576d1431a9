"""`vim-ds train` options as YAML: the recipes shipped with vim_ds (`--config NAME`), a file of one's own
(`--config FILE`), and the record every run writes of its effective options (OUTPUT_DIR/options.yaml), which
`--config OUTPUT_DIR/options.yaml` starts again.

A file maps option names (the dest names: `drop_path`, `num_workers`; `drop-path` is read as the same) to values;
the optional `recipe:` mapping describes a shipped recipe (stage, gpus, source, requires) and sets no option.

A run resumed with other options keeps its record true: the top level stays the options it started with, and
`segments:` lists each later part of the run, `{from_step: N, options: {what changed}}`, in order (`write_run`);
options that change how or where a run runs, not what it computes (NOT_PART_OF_THE_RUN), are not counted.
`--config` of such a file repeats the first segment, with a note naming the later ones (`segments_note`);
`vim-ds compare-runs` compares the first segments and lists the later ones. A file without `segments:` (every
file written before they existed) is one segment.
The record names files absolute (PATH_OPTIONS: it replays from any working directory), holds the values a DeepSpeed
config set as they ran (SETTLED), and is compared by what paths resolve to (`same_value`). A key given twice in one
mapping of a file is refused (YAML would keep the last).
The command line wins over the file: run_options.parse_config builds the run's RunConfig from the file's values,
then what was typed. Every value is made its option's by the option itself (run_config.Option.coerce: its type,
count and choices), so `lr: 1e-3` (a string to YAML 1.1) is the float 0.001, and a wrong value is a one-line error
naming the file and the key. What the options derive from each other is run_config's (`derived`), read here too.
"""
from __future__ import annotations

import difflib
import os

import yaml

from ..runtime import write_journal
from . import shipped_configs
from .run_config import OPTIONS, RunConfig, derived

OPTIONS_FILE = "options.yaml"  # in the run's --output_dir
META_KEY = "recipe"
META_FIELDS = {"stage", "gpus", "source", "requires", "description"}
# not options of a run: the file itself, what the launcher sets, DeepSpeed's flags that change nothing here, and
# a measurement asked of one invocation (--profile-steps: a run started again from its options.yaml profiles nothing)
NOT_RECORDED = ("config", "local_rank", "deepspeed", "deepscale", "deepscale_config", "profile_steps")
SEGMENTS_KEY = "segments"
# options a resume may change without starting a segment: they change how or where the run runs (resuming, paths,
# workers, timeouts, logging, how often and how many checkpoints are kept), not what it computes
NOT_PART_OF_THE_RUN = ("resume", "output_dir", "num_workers", "data_timeout", "dist_timeout", "log_interval",
                       "pin_mem", "save_interval", "keep_checkpoints", "tensorboard")
# the options the lr schedule is built from: a resume that changes one rebuilds it from the new values
SCHEDULE_OPTIONS = ("lr", "unscale_lr", "min_lr", "warmup_lr", "warmup_epochs", "epochs")
SETTABLE = sorted(dest for dest in OPTIONS if dest not in NOT_RECORDED)  # the keys a file may set
# options that name files or folders: recorded absolute, so that `--config OUTPUT_DIR/options.yaml` started from
# another working directory reads the same data, DeepSpeed config and weights (a shipped config's name, `zero2`, is
# kept: it names the same file from anywhere; `--resume auto` too)
PATH_OPTIONS = ("data_path", "finetune", "init_weights", "save_init_weights", "resume", "output_dir",
                "deepspeed_config")


def option_name(dest: str) -> str:
    """The option as one types it: `--lr`, `--num_workers`, `--drop-path` (the dest itself if no option has it)."""
    return OPTIONS[dest].flag if dest in OPTIONS else dest


def _convert(dest: str, value, where: str):
    """A file's value of option `dest`, as the option holds it (run_config.Option.coerce); a ValueError names
    `where` (the file and the key)."""
    try:
        return OPTIONS[dest].coerce(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


class _KeyGivenTwice(Exception):
    """A key that appears twice in one YAML mapping: (key, the line of its first and of its second appearance)."""


def _unique_key_loader():
    """YAML's safe loader, refusing a key given twice in one mapping: YAML requires keys to be unique, but PyYAML
    keeps the last value without a word (`batch_size: 16`, later `batch_size: 4`, trained with 4)."""
    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first_line = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first_line
                except TypeError:  # an unhashable key: the safe loader's own error says so
                    break
                if seen:
                    raise _KeyGivenTwice(key, first_line[key], key_node.start_mark.line + 1)
                first_line[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def read(path: str) -> dict:
    """The mapping a YAML option file holds, or a one-line ValueError (a key given twice in one mapping too)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_unique_key_loader())  # a SafeLoader
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except _KeyGivenTwice as exc:
        key, first, again = exc.args
        raise ValueError(f"--config {path}: {str(key)!r} is given twice (lines {first} and {again}); keep one") \
            from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--config {path}: not valid YAML{at} ({getattr(exc, 'problem', None) or exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got a "
                         f"{type(data).__name__}")
    return data


def load(path: str) -> tuple[dict, dict]:
    """(option dest -> value, the `recipe:` description) from the file; a ValueError names the first bad key."""
    data = read(path)
    options, meta, segments = {}, {}, []
    for key, value in data.items():
        key = str(key)
        if key == META_KEY:
            if not isinstance(value, dict) or not set(map(str, value)) <= META_FIELDS:
                raise ValueError(f"--config {path}: `{META_KEY}:` describes a recipe with the keys "
                                 f"{', '.join(sorted(META_FIELDS))}")
            meta = dict(value)
            continue
        if key == SEGMENTS_KEY:
            segments = _segments(value, f"--config {path}: {SEGMENTS_KEY}")
            continue
        dest = key.lstrip("-").replace("-", "_")
        if dest not in SETTABLE:
            close = difflib.get_close_matches(dest, SETTABLE, n=1, cutoff=0.6)
            hint = f" (did you mean {option_name(close[0])}, `{close[0]}:`?)" if close else ""
            raise ValueError(f"--config {path}: unknown option {key!r}{hint}")
        if dest in options:
            raise ValueError(f"--config {path}: {key!r} is given twice")
        options[dest] = _convert(dest, value, f"--config {path}: {key}")
    if segments:
        meta = {**meta, SEGMENTS_KEY: segments}
    return options, meta


def _segments(value, where: str) -> list[dict]:
    """The `segments:` of a run's record, checked and converted: [{"from_step": N, "options": {dest: value}}]."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of {{from_step: N, options: {{...}}}}, got {value!r}")
    out = []
    for n, segment in enumerate(value, 1):
        here = f"{where} #{n}"
        if not isinstance(segment, dict) or set(segment) != {"from_step", "options"} \
                or not isinstance(segment["options"], dict):
            raise ValueError(f"{here}: expected {{from_step: N, options: {{...}}}}, got {segment!r}")
        step = segment["from_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{here}: from_step must be a whole number, 0 or more, got {step!r}")
        options = {}
        for key, item in segment["options"].items():
            dest = str(key).lstrip("-").replace("-", "_")
            if dest not in SETTABLE:
                raise ValueError(f"{here}: unknown option {key!r}")
            options[dest] = _convert(dest, item, f"{here}: {key}")
        out.append({"from_step": step, "options": options})
    return out


def read_segments(data: dict, where: str) -> list[dict]:
    """The later segments of a run's record (`read`'s mapping), checked: [] for a run of one segment."""
    if SEGMENTS_KEY not in data:
        return []
    return _segments(data[SEGMENTS_KEY], f"{where}: {SEGMENTS_KEY}")


def shown(value) -> str:
    """An option's value as a command line would spell it (used by notes here and by compare-runs)."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(map(shown, value))
    if isinstance(value, dict):
        return " ".join(f"{k}={shown(v)}" for k, v in value.items()) or "(none)"
    return "(not set)" if value is None or value == "" else str(value)


def _default(dest: str):
    return OPTIONS[dest].default if dest in OPTIONS else None


def segment_changes(segment: dict, before: dict) -> str:
    """`--lr 0.05 (was 0.01), --epochs 3 (was 2)`: what a segment changed, from the options in effect `before`."""
    return ", ".join(f"{option_name(dest)} {shown(value)} (was {shown(before.get(dest, _default(dest)))})"
                     for dest, value in segment["options"].items())


def describe_segments(first: dict, segments: list[dict]) -> list[str]:
    """One `from step N: --lr 0.05 (was 0.01)` per later segment of a run whose first segment ran with `first`."""
    current, lines = dict(first), []
    for segment in segments:
        lines.append(f"from step {segment['from_step']}: {segment_changes(segment, current)}")
        current.update(segment["options"])
    return lines


def segments_note(path: str, first: dict, segments: list[dict]) -> str:
    """The note `--config` of a multi-segment record prints: what it repeats, and what it does not."""
    return (f"note: --config {path} records a run whose options changed during it ("
            f"{'; '.join(describe_segments(first, segments))}); this run repeats its first segment, the "
            f"options it started with; to repeat a later one, stop at its step (--max-steps) and resume with its "
            f"options")


def write_run(path: str, options: dict, step: int | None = None) -> str | None:
    """Record a run's options (`record`) in `path`. A fresh run (step None), or one without a readable record,
    writes them whole. A run resumed at `step` keeps the record it continues: when an option that matters
    (not NOT_PART_OF_THE_RUN) differs from what was in effect, a segment {from_step, options: the changed ones} is
    appended, and the returned note says which; the same options leave the file as it is (None)."""
    write_journal.rewriting(path)  # a run refused before its first step puts it back
    if step is None or not os.path.isfile(path):
        write(path, options)
        return None
    try:
        data = read(path)
        first, meta = load(path)
    except ValueError as exc:
        write(path, options)
        return f"note: {path} could not be read ({exc}); written again with this run's options"
    segments = meta.get(SEGMENTS_KEY, [])
    current = dict(first)
    for segment in segments:
        current.update(segment["options"])
    changed = {dest: value for dest, value in options.items()
               if dest not in NOT_PART_OF_THE_RUN and not same_value(dest, value, current.get(dest, _default(dest)))}
    if not changed:
        return None
    segment = {"from_step": int(step), "options": changed}
    what = segment_changes(segment, current)
    data[SEGMENTS_KEY] = list(data.get(SEGMENTS_KEY) or []) + [segment]
    write(path, data)
    rebuilt = any(dest in SCHEDULE_OPTIONS for dest in changed)
    return (f"note: resuming with options that differ from {path}: {what}; recorded there as a segment from step "
            f"{step}" + ("; the lr schedule is rebuilt from the new values" if rebuilt else ""))


def same_value(dest: str, a, b) -> bool:
    """Do two recorded values of option `dest` mean the same run? Equal values do; two spellings of one file or
    folder do too (a relative path and its absolute one, as older records hold them; a shipped DeepSpeed config's
    name and its path): they are compared by what they resolve to (relative paths from the working directory)."""
    a, b = plain(a), plain(b)
    if a == b:
        return True
    if dest not in PATH_OPTIONS or not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    return _resolved(dest, a) == _resolved(dest, b)


def _resolved(dest: str, value: str) -> str:
    """The file or folder a path option's value names (`auto` for `--resume auto`)."""
    if dest == "resume" and value == "auto":
        return value
    if dest == "deepspeed_config":
        try:
            value = shipped_configs.resolve(value)
        except ValueError:
            pass  # names nothing here: compared as it is
    return os.path.realpath(value)


def _absolute(dest: str, value):
    """A path option's value as recorded: absolute (see PATH_OPTIONS); empty, `auto` and a shipped config's name as
    they are."""
    if not value or (dest == "resume" and value == "auto"):
        return value
    if dest == "deepspeed_config" and not os.path.exists(value):
        return value  # a shipped config's name (or nothing the checks will find: they say so)
    return os.path.abspath(value)


# the options the checks settle with the DeepSpeed config (engine/preflight.py, optim.settle_shared: a number in the
# JSON that the command line did not give): recorded as they run, so that the record says what ran and `--config`
# of it repeats the run with another DeepSpeed config too (the precision: --precision as given, or the recorded
# config's sections, as before)
SETTLED = ("lr", "unscale_lr", "weight_decay", "opt_betas", "opt_eps", "clip_grad")


def with_settled(options: dict, config: RunConfig) -> dict:
    """A run's record (`record`) with the values of SETTLED as `config` (the checked config) holds them."""
    values = config.to_dict()
    return {**options, **{dest: plain(values[dest]) for dest in SETTLED}}


def record(config: RunConfig) -> dict:
    """The effective options of a run (its RunConfig) as a YAML-ready mapping (tuples as lists), in the order of
    --help (the options are config/run_config.py's); paths absolute (PATH_OPTIONS)."""
    values, derived_values = config.to_dict(), derived(config)
    out = {}
    for dest in OPTIONS:
        if dest in NOT_RECORDED:
            continue
        value = values[dest]
        if dest == "deepspeed_config" and not value:
            value = shipped_configs.DEFAULT  # what the run used, said as the trainer says it
        elif dest in derived_values and value == derived_values[dest]:
            # derived from the other options (run_config.derived): derived again from the file's other values
            value = None
        elif dest in PATH_OPTIONS:
            value = _absolute(dest, value)
        out[dest] = plain(value)
    return out


def plain(value):
    """A value YAML's safe dumper writes: tuples as lists, anything else unusual (a Path set by a caller) as text."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def write(path: str, options: dict) -> None:
    text = yaml.safe_dump(options, sort_keys=False, default_flow_style=None)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("# vim-ds train: this run's effective options, written at its start. Start the same run again with\n"
                "#   vim-ds train --config THIS_FILE --output_dir ANOTHER_DIR"
                "   (the command line wins over the file)\n")
        if options.get(SEGMENTS_KEY):
            f.write(f"# It was resumed with other options: `{SEGMENTS_KEY}:` (at the end) lists from which step each "
                    f"later part ran\n# with which options changed; --config repeats the first part (the top "
                    f"level).\n")
        f.write(text)
    os.replace(path + ".tmp", path)
