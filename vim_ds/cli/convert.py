"""`vim-ds convert CKPT_DIR OUT` = `python -m vim_ds.convert`: a training checkpoint directory (any ZeRO stage,
any rank count) -> one .pth in the published Vim format ({"model": ..., "model_ema": ..., "vim_ds": {...}}) or a
.safetensors file. See vim_ds.checkpoint.convert."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

from ..checkpoint import convert as checkpoint_convert
from ..checkpoint import deepspeed_dir
from ..checkpoint.files import CheckpointError
from ..engine.checkpointing import UNIVERSAL_SUFFIX, universal_copy
from ..runtime import env_vars, faults
from ..runtime.errors import report_error


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vim-ds convert", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="CKPT_DIR", help="save directory (newest complete checkpoint), "
                   "tag directory (checkpoints/global_stepN) or training --output_dir")
    p.add_argument("out", metavar="OUT", nargs="?", help="output file (.pth, or .safetensors)")
    p.add_argument("--tag", default=None, help="which checkpoint of the save directory (e.g. global_step1200)")
    p.add_argument("--ema", action="store_true", help="write the EMA weights as the 'model' weights")
    p.add_argument("--safetensors", action="store_true", default=None,
                   help="write safetensors (default: when OUT ends in .safetensors)")
    p.add_argument("--universal", action="store_true",
                   help="instead: write DeepSpeed's universal checkpoint next to it (<tag>_universal), which any "
                        "rank count can resume (vim-ds train does this by itself when the rank count changes)")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if not args.universal and not args.out:
        p.error("OUT is required (or --universal)")
    return args


class Stopped(BaseException):
    """A stop signal arrived (raised by the handler in the main thread, wherever it is: the write's clean-up runs)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stop_on_signals() -> dict:
    """SIGTERM (kill, a scheduler), SIGINT (Ctrl-C), SIGHUP (the terminal closed) stop the conversion with its
    temporary files removed, one line and exit 128 + the signal, instead of a traceback or a Python exit that skips
    the clean-up. A SIGHUP the process was started ignoring (nohup) stays ignored. SIGKILL cannot be caught: what
    it leaves is described in vim_ds/checkpoint/atomic_write.py."""
    def on_signal(signum, _frame):
        # the clean-up is not cut short by a second signal (or a second Ctrl-C)
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        raise Stopped(signum)

    # main() called from a thread: Python's own
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        if signum != signal.SIGHUP or previous[signum] is not signal.SIG_IGN:
            signal.signal(signum, on_signal)
    return previous  # main() puts them back (it may run inside another program: a test, a notebook)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))

    refused = env_vars.refusal("vim-ds convert")  # a VIM_DS_* variable it cannot read: one line
    if refused:
        return refused
    existed = bool(args.out) and os.path.isfile(args.out)
    target = [args.out]  # what a stop leaves unwritten (the universal folder, once it is known)
    previous = _stop_on_signals()
    try:
        return _main(args, target)
    except Stopped as stop:
        if target[0]:
            unchanged = " (the existing file is unchanged)" if existed and not args.universal else ""
            print(f"vim-ds convert: stopped by {stop}; {target[0]} was not written{unchanged}", file=sys.stderr)
        else:
            print(f"vim-ds convert: stopped by {stop}; nothing was written", file=sys.stderr)
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _main(args, target: list) -> int:
    # DeepSpeed's logger (bound to stdout at import) -> stderr, so that stdout is the one-line summary; imported
    # here, not at the top: seconds of start-up that `vim-ds convert --help` and a bad argument need not pay
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed.utils.zero_to_fp32  # noqa: F401

    try:
        # fault injection (VIM_DS_INJECT=stall_convert_write@1): stop mid-write for a signal test
        stall = None
        if faults.number("stall_convert_write", 0) is not None:
            stall = lambda: faults.stall(f"writing {target[0]}")  # noqa: E731
        if args.universal:
            return _universal(args, target, stall)
        s = checkpoint_convert.convert(
            args.checkpoint, args.out, tag=args.tag, ema=args.ema, safetensors=args.safetensors,
            progress=lambda message: print(f"vim-ds convert: {message}", file=sys.stderr, flush=True), stall=stall)
    except (CheckpointError, OSError) as exc:
        return report_error("vim-ds convert", exc)
    ema = "" if args.ema or not s["has_ema"] else " + EMA"
    print(f"wrote {s['out']} ({s['format']}): {s['model']} {s['weights']} weights{ema}, {s['tensors']} tensors, "
          f"{s['parameters']:,} parameters, {s['num_classes']} classes, step {s['step']} "
          f"(ZeRO-{s['zero_stage']} {s['precision']}) from {s['source']}")
    return 0


def _universal(args, target: list, stall=None) -> int:
    save_dir, tag = deepspeed_dir.resolve(os.path.join(deepspeed_dir.save_dir_of(args.checkpoint), args.tag)
                                          if args.tag else args.checkpoint)
    target[0] = os.path.join(save_dir, tag + UNIVERSAL_SUFFIX)
    # a failed or stopped conversion removes its partial folder
    universal = universal_copy(save_dir, tag, stall)
    print(f"wrote {os.path.join(save_dir, universal)} (DeepSpeed universal checkpoint): resume it with "
          f"--resume {os.path.join(save_dir, universal)} on any number of ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
