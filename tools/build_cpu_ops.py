"""Build DeepSpeed's two CPU ops into the torch extension cache (~/.cache/torch_extensions, or
TORCH_EXTENSIONS_DIR): cpu_adam, which ZeRO offload runs on, and the shared-memory all-reduce that multi-rank CPU runs
use. DeepSpeed compiles each one the first time a process needs it, inside that run; building them first moves the
compile out of it (on a cluster with a shared home: once, before the first jobs). The build is keyed on this
interpreter's torch, so run it with the environment's own `python`.

    python tools/build_cpu_ops.py

`bash tools/test.sh` runs it in the lane beside its two workers, whose jobs mostly sleep, so that the suite's first
offloaded and first multi-rank tests find the ops built (on the 2-core Xeon cpu_adam takes ~75 s and ~135
CPU-seconds)."""
import resource
import sys
import time

from deepspeed.accelerator import get_accelerator

def cpu_seconds() -> float:  # this process's and the compilers' (its waited-for children)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):  # the all-reduce first: the suite's first runs need it
    start, cpu = time.monotonic(), cpu_seconds()
    try:
        get_accelerator().create_op_builder(name).load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - the run that needs the op builds it again and fails with the cause
        sys.exit(f"build_cpu_ops: {name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    print(f"build_cpu_ops: {name} ready in {time.monotonic() - start:.0f} s, {cpu_seconds() - cpu:.0f} CPU-seconds")
