"""Write a file so that it appears whole or not at all, however the writer stops (`vim-ds convert`'s OUT,
`--save-init-weights`, `vim-ds export`'s program), and never onto a file the command reads (`same_file`).

Where the bytes go while they are written:
- Linux (ext4, xfs, btrfs, tmpfs, ...): an *unnamed* file in OUT's folder (`open(O_TMPFILE)`). It has no name
  until it is complete, so a writer stopped in any way, SIGKILL and the OOM killer included, leaves nothing: the
  kernel frees its blocks when the process ends. Complete, it is fsynced and linked into the folder (`linkat`
  through /proc/self/fd), then renamed over OUT: OUT is the old file or the new one, never part of one.
- Where O_TMPFILE is not supported (NFS, other systems) or VIM_DS_NO_TMPFILE=1: a hidden file next to OUT,
  `.OUT.tmp.HOST.PID`, renamed over OUT when complete. An error or a caught signal removes it; a SIGKILL cannot be
  caught and leaves it, so every write into a folder first removes the temporaries there whose writer (this host,
  that pid) has ended, and the `OUT.tmpPID` files earlier versions left behind for the same OUT.

A failed write is a `CheckpointError` naming OUT and the cause in a few words (`No space left on device`,
`Read-only file system`, ...), whichever layer noticed it: an OSError, torch's zip writer (whose RuntimeError
says only `unexpected pos ...`) or safetensors' error.
"""
from __future__ import annotations

import errno
import os
import re
import socket

from .files import CheckpointError

HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"


def temporary_name(out_path: str, pid: int | None = None) -> str:
    """The hidden name OUT has while it is written where the file cannot stay unnamed (see the module docstring)."""
    folder, name = os.path.split(os.path.abspath(out_path))
    return os.path.join(folder, f".{name}.tmp.{HOST}.{os.getpid() if pid is None else pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(out_path: str) -> list[str]:
    """Remove the temporaries of writers into OUT's folder that have ended (killed with SIGKILL); returns them."""
    folder, name = os.path.split(os.path.abspath(out_path))
    ours = re.compile(rf"^\..+\.tmp\.{re.escape(HOST)}\.(\d+)$")
    # `OUT.tmpPID` of vim_ds versions before this one
    legacy = re.compile(rf"^{re.escape(name)}\.tmp(\d+)$")
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        match = ours.match(entry) or legacy.match(entry)
        if not match or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        path = os.path.join(folder, entry)
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def same_file(path: str, others) -> str | None:
    """The first of `others` that is the very file at `path` (the same device and inode: through a symlink or a
    hard link too), or None; None when `path` does not exist."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    for other in others:
        try:
            found = os.stat(other)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (stat.st_dev, stat.st_ino):
            return other
    return None


def files_under(folder: str) -> list[str]:
    """Every file under `folder` (what a command reads from a checkpoint folder)."""
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


def _unnamed_file(folder: str) -> int | None:
    """An O_TMPFILE descriptor in `folder` that can be reopened and linked through /proc, or None."""
    if os.environ.get("VIM_DS_NO_TMPFILE") == "1" or not hasattr(os, "O_TMPFILE"):
        return None
    try:
        # the umask applies, as for a named file
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o666)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None  # the filesystem (or kernel) has no O_TMPFILE: a named temporary instead
        raise
    if not os.path.exists(f"/proc/self/fd/{fd}"):
        os.close(fd)
        return None
    return fd


def _cause(exc: BaseException, folder: str, shown: str | None = None) -> str:
    """Why a write failed, in a few words (checked before the temporary is freed: a full disk is still full)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:  # torch's writer: "unexpected pos ..."; safetensors: "... (os error 28)"
        match = re.search(r"os error (\d+)|\[Errno (\d+)\]", str(exc))
        code = int(match.group(1) or match.group(2)) if match else None
    try:
        fs = os.statvfs(folder)
    except OSError:
        fs = None
    if code is None and fs is not None:
        if fs.f_bavail * fs.f_frsize < 2 ** 20:
            code = errno.ENOSPC
        elif fs.f_flag & os.ST_RDONLY:
            code = errno.EROFS
    if code is None:
        return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    cause = os.strerror(code)
    if code in (errno.ENOSPC, errno.EDQUOT) and fs is not None:
        cause += f" ({fs.f_bavail * fs.f_frsize / 2 ** 20:,.1f} MiB free in {shown or folder})"
    return cause


def write_atomically(out_path: str, write, stall=None, replace: bool = True) -> None:
    """Call `write(path)` to write the file that becomes `out_path` (see the module docstring); `path` is where
    the writer opens and writes its bytes. `stall()`, when given, runs once the bytes are written, before OUT gets
    them (fault injection: a test stops the writer there). Without `replace`, OUT must not exist when the file is
    put in place (a hard link, which fails on an existing name: no check-then-write race): a file that appeared
    meanwhile is kept and the write fails with `File exists`."""
    shown = os.fspath(out_path)  # the path as the user gave it, in messages
    shown_folder = os.path.dirname(shown) or "."
    out_path = os.path.abspath(shown)
    folder = os.path.dirname(out_path)
    try:
        os.makedirs(folder, exist_ok=True)
        remove_stale_temporaries(out_path)
        fd = _unnamed_file(folder)
    except OSError as exc:
        raise CheckpointError(f"cannot write {shown}: {_cause(exc, folder, shown_folder)}") from exc
    staged = temporary_name(out_path)
    try:
        if fd is None:
            if os.path.lexists(staged):
                os.remove(staged)
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            write(staged)
        else:
            write(f"/proc/self/fd/{fd}")
        os.fsync(fd)
        if stall is not None:
            stall()
        # the unnamed file gets its (hidden) name now that it is whole
        if not os.path.lexists(staged):
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(f"/proc/self/fd/{fd}", os.path.basename(staged), src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                        # linkat(AT_SYMLINK_FOLLOW): the file behind the descriptor
                        follow_symlinks=True)
            finally:
                os.close(dir_fd)
        if replace:
            os.replace(staged, out_path)
        else:
            os.link(staged, out_path)
            os.remove(staged)
        _fsync_folder(folder)
    # an error, Ctrl-C, a caught SIGTERM: nothing of the new file is left
    except BaseException as exc:
        cause = _cause(exc, folder, shown_folder) if isinstance(exc, Exception) else None
        if fd is not None:
            os.close(fd)
            fd = None
        try:
            os.remove(staged)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError":
            raise CheckpointError(f"cannot write {shown}: {cause}") from exc
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _fsync_folder(folder: str):
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
