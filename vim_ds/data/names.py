"""How a class name is shown in a message, so that a user can tell it from another that prints the same.

A folder name is bytes on disk, and vim_ds takes it as it is: ImageFolder's labels are the names sorted by code
point, and a checkpoint records them so. Two names can print alike and still be two names: `zéro` as macOS writes it
(NFD: `e` + U+0301 COMBINING ACUTE ACCENT) and as most Linux tools do (NFC: U+00E9), `7` and `7 `, `cat` and `cat`
with a zero-width space or a byte-order mark in it. They sort apart (another label), name other folders, and would be
two classes shown alike; vim_ds does not merge them (which form would be the one the checkpoint records?) but shows
the difference where it names them: `quoted` escapes what cannot be seen, `alike` says why two names look the same.
"""
from __future__ import annotations

import unicodedata


def _nfc(name: str) -> bool:
    return unicodedata.is_normalized("NFC", name)


def quoted(name: str) -> str:
    """`name` quoted with what a terminal would not show escaped: spaces at the ends show inside the quotes,
    invisible characters as `\\u200b` (Python's repr), and every non-ASCII character of a name not in NFC as its code
    point (`'ze\\u0301ro'`), since its combining marks print like the composed letter."""
    return repr(name) if _nfc(name) else ascii(name)


def plain(name: str) -> bool:
    """Whether `name` prints as itself, unmistakably: not empty, every character visible, no space at an end, NFC."""
    return bool(name) and name.isprintable() and name == name.strip() and _nfc(name)


def shown(name: str) -> str:
    """`name` as it is where it prints unmistakably (`n01440764`, `zéro`), else `quoted(name)`."""
    return name if plain(name) else quoted(name)


def unicode_form(name: str) -> str:
    if _nfc(name):
        return "NFC"
    return "NFD" if unicodedata.is_normalized("NFD", name) else "mixed"


def _visible(name: str) -> str:
    """`name` without what does not print (format characters: zero-width spaces and joiners, a byte-order mark)."""
    return "".join(c for c in name if unicodedata.category(c) != "Cf")


def look_alike_key(name: str) -> str:
    """What is left of `name` on a terminal: two names with the same key look the same there."""
    return unicodedata.normalize("NFC", _visible(name)).strip()


def alike(a: str, b: str) -> str | None:
    """Why the different names `a` and `b` look the same when printed, or None when they do not."""
    if a == b or look_alike_key(a) != look_alike_key(b):
        return None
    if unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b):
        forms = (unicode_form(a), unicode_form(b))
        macos = "; macOS writes names in NFD" if "NFD" in forms else ""
        return f"the same letters in two Unicode forms ({forms[0]} and {forms[1]}{macos})"
    if _visible(a) != a or _visible(b) != b:
        return "the same name but for invisible characters"
    return "the same name but for spaces at an end"
