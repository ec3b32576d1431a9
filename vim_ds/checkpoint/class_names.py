"""The class names a run was trained on, and the names of the data its weights meet again.

A label is an index into the sorted class folder names, so the names are part of what a run is: with them renamed,
added or removed (`train/3` renamed `z3`), the same count of folders gives labels 3-9 to other images, and a resume,
a finetune, an evaluation or a prediction goes on with the classes shifted, without a word. The trainer records
the names in every checkpoint (its client state, "classes"), `vim-ds convert` in every file it writes (the .pth
"vim_ds" entry, and the safetensors metadata as a JSON list), and whatever uses the weights with data compares them
here: the same names in the same order, or a one-line refusal that shows the difference. Files without recorded
names (written before, published, timm's) are taken as before: only the class count is known there.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from ..data.names import alike, look_alike_key, quoted, shown
from .convert import read_vim_ds_meta
from .files import CheckpointError, is_safetensors, load_into, load_weights_file, select_weights


def recorded(meta: dict | None, num_classes: int | None = None) -> list[str] | None:
    """The class names a checkpoint's client state or a converted file's description records (None when it records
    none, or when they do not fit the head's `num_classes`)."""
    names = (meta or {}).get("classes")
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        return None
    if num_classes is not None and len(names) != num_classes:
        return None
    return list(names)


def data_source(data) -> str:
    """How the user named the data a run reads (for the messages); `data`: the run's data set (a
    `vim_ds.data.datasets.DatasetConfig`: its `data_set` and `data_path`)."""
    if data.data_set == "synthetic":
        return "--data-set synthetic"
    return f"--data-path {data.data_path}"


def _shown(name: str) -> str:
    """`name` as it is, or quoted where it would not print unmistakably (`names.quoted`: `'ze\\u0301ro'`, `'7 '`) or
    would read as part of a listing (a comma, `...`)."""
    return quoted(name) if "," in name or "..." in name else shown(name)


def listing(names: list[str], most: int = 10) -> str:
    """`names` in one short piece: runs of 4 or more consecutive integers as `a..b`, the middle elided when long
    (`0..2,4..9,z3`; `n01440764,n01443537,...,n15075141`)."""
    parts, i = [], 0
    while i < len(names):
        j = i
        while j + 1 < len(names) and names[j + 1].isdigit() and names[j].isdigit() \
                and str(int(names[j])) == names[j] and names[j + 1] == str(int(names[j]) + 1):
            j += 1
        if j - i >= 3:
            parts.append(f"{names[i]}..{names[j]}")
        else:
            parts.extend(_shown(n) for n in names[i:j + 1])
        i = j + 1
    if len(parts) > most:
        parts = parts[:most - 4] + ["..."] + parts[-3:]
    return ",".join(parts)


def _some(names: list[str], most: int = 3) -> str:
    shown = ", ".join(map(_shown, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _labels(indices: list[int]) -> str:
    """`3-9`, `3, 5`, `2-4, 7 and 12 more`."""
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    return ", ".join(text[:3]) + (f" and {len(text) - 3} more" if len(text) > 3 else "")


def _counted(n: int) -> str:
    return {1: "one", 2: "two", 3: "three"}.get(abs(n), str(abs(n)))


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(n, f"{n} times")


def _what_differs(was: list[str], now: list[str]) -> list[str]:
    """The names missing here, new here and listed more often here than there, as phrases; a new name that prints
    like a missing one (`zéro` in NFD here, in NFC there) is said to be so, once."""
    was_count, now_count = Counter(was), Counter(now)
    missing = [n for n in was_count if n not in now_count]
    new = [n for n in now_count if n not in was_count]
    repeated = [n for n in now_count if now_count[n] > max(1, was_count[n])]
    what = []
    missing_by_look = {look_alike_key(m): m for m in missing}
    twin = next(((n, missing_by_look[look_alike_key(n)]) for n in new if look_alike_key(n) in missing_by_look), None)
    if twin:  # said as one: the name here is the one there, written otherwise
        what.append(f"{_shown(twin[0])} here and {_shown(twin[1])} there are {alike(*twin)}")
        new.remove(twin[0])
        missing.remove(twin[1])
    if missing:
        what.append(f"class{'es' if len(missing) > 1 else ''} {_some(missing)} "
                    f"{'are' if len(missing) > 1 else 'is'} missing here")
    if new:
        what.append(f"{_some(new)} {'are' if len(new) > 1 else 'is'} new")
    for name in repeated[:3]:
        what.append(f"{_shown(name)} is listed {_times(now_count[name])}")
    if len(repeated) > 3:
        what.append(f"{len(repeated) - 3} more names are listed more than once")
    return what


def difference(was: list[str], now: list[str]) -> str:
    """What differs between the names a checkpoint was trained on (`was`) and those of the data (`now`), and what it
    would do to the labels: `class 3 is missing here and z3 is new (labels 3-9 would shift by one)`. Names are
    compared as they are (a folder name is bytes on disk), and shown so that two that print alike can be told apart.
    """
    was_set = set(was)
    what = _what_differs(was, now) or [f"the same {len(was)} names in another order"]
    changed = [i for i in range(min(len(was), len(now))) if was[i] != now[i]]
    if not changed:  # one list is the other's beginning: only a count of classes differs
        return " and ".join(what)
    shifts = {was.index(now[i]) - i for i in changed if now[i] in was_set}
    if len(shifts) == 1 and len([i for i in changed if now[i] in was_set]) > 1:
        shift = shifts.pop()
        effect = f"labels {_labels(changed)} would shift by {_counted(shift)}"
    else:
        first = changed[0]
        others = len(changed) - 1
        more = "" if not others else f", and {others} more label{'s differ' if others > 1 else ' differs'}"
        effect = f"label {first} was {_shown(was[first])}, here {_shown(now[first])}{more}"
    return " and ".join(what) + f" ({effect})"


def refusal(source: str, was: list[str] | None, where: str, now: list[str] | None, fix: str) -> str | None:
    """The one-line refusal when `source` was trained on other class names than those `where` has, else None
    (also when either side names none: nothing to compare)."""
    if not was or not now or list(was) == list(now):
        return None
    return (f"{source} was trained on {len(was)} classes {listing(was)}; {where} has "
            f"{f'{len(now)} classes ' if len(now) != len(was) else ''}{listing(now)}: {difference(was, now)}; {fix}")


def check(source: str, was: list[str] | None, where: str, now: list[str] | None, fix: str) -> None:
    problem = refusal(source, was, where, now, fix)
    if problem:
        raise CheckpointError(problem)


def of_file(path: str, obj: dict | None = None, num_classes: int | None = None) -> list[str] | None:
    """The names a weights file records (`obj`: the file as loaded, to avoid reading a .pth twice)."""
    path = os.fspath(path)
    # a loaded .pth carries its description; a safetensors file (whatever its name) keeps it in its metadata, which
    # a loaded state dict does not carry
    source = path if obj is None or is_safetensors(path) else obj
    try:
        return recorded(read_vim_ds_meta(source), num_classes)
    except (CheckpointError, ValueError, OSError):
        return None  # not readable as a converted file's description: what loads it says why


def load_finetune_weights(model, path: str, classes: list[str] | None, where: str) -> str | None:
    """`--finetune FILE`: load its weights into `model` (position embeddings and head adapted as for any published
    file). When the file records class names and the head would be kept (the same class count), they must be the
    data's: the same names in another order, or some renamed, would start every row of the head on another class
    (refused). A file of wholly other names of the same count (another task) starts a fresh head, as another count
    does; returns the note that says so."""
    path = os.fspath(path)
    obj = load_weights_file(path)
    state = select_weights(obj, path)
    head = state.get("head.weight")
    rows = head.shape[0] if isinstance(head, torch.Tensor) and head.dim() == 2 else None
    was = of_file(path, obj, rows)
    note = None
    if was and classes and len(was) == len(classes) and was != list(classes):
        if set(was) & set(classes):
            raise CheckpointError(refusal(f"--finetune {path}", was, where, list(classes),
                                          "its head's rows would start on other classes; finetune on data with its "
                                          "class names in its order (rename the folders back)"))
        # another task: a fresh head
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        note = (f"note: --finetune {path} was trained on other classes ({listing(was)}) than {where} has "
                f"({listing(list(classes))}): its head is not used, the head starts afresh")
    load_into(model, state, path)
    return note
