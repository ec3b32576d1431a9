"""Process-group set-up and the few collectives the trainer needs, the same on CUDA, ROCm and CPU (gloo).

The deepspeed launcher, torchrun and SLURM wrappers export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; a plain
`python -m vim_ds.train` exports nothing and runs as a world of one.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import util
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import build_tools
from .ports import free_port  # setup() below; bench/split.py imports it from here too

# --data-timeout's default: far above a healthy batch (even the first, which starts the workers), far below 600 s; and
# at most half of --dist-timeout, so that a stalled rank stops the job before its peers' collectives time out
DATA_TIMEOUT = 120.0


def default_data_timeout(dist_timeout: float) -> float:
    return min(DATA_TIMEOUT, dist_timeout / 2)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(local_rank_arg: int = -1, timeout_s: float = 600) -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (nccl/rccl on GPUs, gloo on CPU) and pick this rank's device.

    `timeout_s` bounds every collective: a rank waiting longer than that for a peer (dead, stuck, or on a node that
    lost its network) raises instead of hanging the job forever. A peer that *dies* is usually noticed sooner: its
    sockets close and gloo fails at once, and the launcher stops the other local ranks. NCCL/RCCL enforce the
    timeout through their watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default in torch 2.x).
    """
    # DeepSpeed here, not at the top: seconds of start-up, after every check a rank makes before the process group
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as ds_logger

    # DeepSpeed logs every engine detail at INFO on every rank; we report what matters ourselves.
    ds_logger.setLevel(logging.WARNING)
    # DeepSpeed 0.19 still calls torch.distributed collectives that torch 2.14 deprecates, once per call site.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if "RANK" not in os.environ:  # a single process started by hand
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(max(local_rank_arg, 0)), LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    local_rank = int(os.environ.get("LOCAL_RANK", max(local_rank_arg, 0)))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    _default_group_timeout(timedelta(seconds=timeout_s))
    _choose_gloo_interface()
    # before DeepSpeed builds its first op (cpu_adam, FusedAdam: in deepspeed.initialize)
    build_tools.extensions_dir_per_install(os.environ)
    without_deepspeed_shm_op()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), auto_mpi_discovery=False,
                                   verbose=False, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    device = torch.device(accelerator.device_name(local_rank)) if accelerator.device_name() != "cpu" \
        else torch.device("cpu")
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads(local_world))
    return DistInfo(dist.get_rank(), world, local_rank, local_world, device)


def cpu_threads(local_world_size: int) -> int:
    """A CPU rank's OpenMP threads when OMP_NUM_THREADS does not say: its share of the cores this process may run on
    (its affinity: taskset, a cgroup's cpuset, SLURM's --cpus-per-task binding), split among the ranks on this node.

    Why a share and not every core: ranks on one host share its cores, and OpenMP threads spin while they wait for
    one another, so two processes with a thread per core each on the same cores burn up to twice the CPU for the
    same work (measured on 2 cores: two 1-rank runs side by side, 20.8-27.4 CPU-s with two threads each, 9.7-10.0
    with one). Jobs that vim_ds cannot see (two runs started side by side, other tenants) should be bound or given
    OMP_NUM_THREADS by whoever starts them: torchrun sets OMP_NUM_THREADS=1 for several ranks itself."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(local_world_size, 1))


# the name DeepSpeed's ShareMemCommBuilder builds under (0.16 to 0.19)
DEEPSPEED_SHM_OP = "deepspeed_shm_comm"


def without_deepspeed_shm_op():
    """Keep `deepspeed.init_distributed` from building DeepSpeed's CPU shared-memory all-reduce.

    On CPU, init_distributed (its TorchBackend) JIT-compiles the `deepspeed_shm_comm` op on first use (40-100
    CPU-seconds, more with torch 2.4's headers) and, when every rank is on one host, each rank writes a 69 MB file
    `/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>` that DeepSpeed never unlinks (18 GB of RAM
    after a day of this suite, before vim_ds removed them). The op serves `deepspeed.comm.inference_all_reduce`
    only (AutoTP inference, which falls back to the process group without it): training's collectives, and every
    one vim_ds makes, go through gloo either way. DeepSpeed builds it only where its install marked it compatible,
    so this process marks it not. On a GPU DeepSpeed has no such op; nothing changes there."""
    # DeepSpeed here, not at the top: as in setup
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False


def _choose_gloo_interface():
    """Set GLOO_SOCKET_IFNAME (when unset, in a job spanning several hosts) to the interface this host reaches the
    master address through. Why: gloo otherwise binds to the address the host name resolves to, a loopback one
    where /etc/hosts maps it to 127.0.1.1 (Debian's default), and every rank of another host then fails to connect
    ("Connection refused, remote=[127.0.0.1]..."). The launch/ scripts choose it in the shell for the per-node modes;
    this covers the rest (deepspeed over pdsh/ssh forwards no such variable, torchrun started by hand)."""
    import psutil  # here, not at the top: a package `import vim_ds` does not load (start-up)

    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 0)) or 0)
    master = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("GLOO_SOCKET_IFNAME") or not master or not local_world or world <= local_world:
        return
    try:
        addr = socket.gethostbyname(master)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            # UDP: nothing is sent, the kernel only picks the route and source address
            probe.connect((addr, 9))
            local = probe.getsockname()[0]
    except OSError:
        return
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"vim-ds: gloo uses network interface {name} ({local}) toward the master {master}",
                      file=sys.stderr, flush=True)
            return


def _default_group_timeout(timeout: timedelta):
    """Make `timeout` the default of every process group created from now on, not only the world group.

    DeepSpeed builds its own groups (ZeRO's data-parallel group, which carries the gradient all-reduce, and its world
    group) with `torch.distributed.new_group(ranks)`, i.e. without a timeout, and torch then gives them its built-in
    default (30 min for gloo, 10 min for NCCL) instead of the world group's: a peer stuck in its step kept the others
    waiting 30 min whatever --dist-timeout said. torch reads that default from these module globals at each
    new_group call.
    """
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over all ranks in one collective (float64, so counts and sums stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def teardown():
    if dist.is_initialized():
        # held across destroy_process_group, so that no group's backend is destroyed inside it (see below)
        backends = _backends_of_every_group()
        dist.destroy_process_group()
        # the backends' last references: their destructors run here, with the GIL released
        del backends


def _backends_of_every_group() -> list:
    """Every process group's backends (gloo, NCCL), as Python objects.

    Why: a backend's destructor joins its worker threads, and a worker that is still freeing a finished collective
    needs the GIL when that collective's tensor was last referenced from Python. torch binds the backends so that
    their destructors release the GIL, and the process groups too in newer releases (2.14); torch 2.4's process
    group, destroyed from Python (destroy_process_group drops the last reference to the world group and to the
    groups only it keeps), holds the GIL while it destroys its backends: a rank hung for good at its exit after a
    2-rank run had finished and saved everything (docs/versions.md). With these references held, a group's
    destructor only lets go of its backends, and each backend is destroyed when this list is, through its own
    GIL-releasing binding; with a newer torch only the order of the two destructions changes.
    """
    backends = []
    for group in list(c10d._world.pg_map):
        for device_type in getattr(group, "_device_types", []):
            try:
                backends.append(group._get_backend(torch.device(device_type)))
            except RuntimeError:  # no backend for that device after all: nothing to hold
                pass
    return backends


def end_rank_process(code: int) -> NoReturn:
    """End a rank's process now with `code`, after run() has settled the outcome, closed its files and called
    teardown(): stdout, stderr and logging are flushed, then os._exit, so nothing runs in the interpreter's
    finalisation.

    Why: destroy_process_group() does not stop gloo's threads (pt_gloo_runloop, gloo_tcp_loop); they are joined
    only when the process-group objects are destroyed, and DeepSpeed keeps those referenced (its module globals,
    the engine, ZeRO-3's parameters) until the interpreter tears itself down. A rank whose gloo threads are torn
    down there can abort (SIGABRT, "terminate called without an active exception") after a run that finished and
    saved everything, and the launcher then reports the job as failed: 2 of 25 finished 2-rank ZeRO-3 runs on 2
    loaded cores (Debian 12's Python 3.11.2) did, none of 45 since they end here.

    os._exit also skips multiprocessing's exit handler, which removes the `pymp-*` folder it made in $TMPDIR (for
    the data loaders' fork-server socket): that one clean-up is run here (`remove_multiprocessing_temp_dir`).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    remove_multiprocessing_temp_dir()
    logging.shutdown()
    os._exit(code)


def remove_multiprocessing_temp_dir() -> None:
    """Remove the `pymp-*` folder multiprocessing made in $TMPDIR for this process (`util.get_temp_dir`: the
    sockets of the fork server and of passed file descriptors), as its exit handler would.

    Only that finalizer is run, not the handler (`util._exit_function`): the handler also joins non-daemon child
    processes and the feeder threads of queues, which can wait for good on a worker that is stuck or a pipe nobody
    reads, the kind of teardown wait os._exit is there to avoid. The folder's finalizer is an rmtree and cannot wait
    on anything; it runs only in the process that registered it (a folder inherited from a parent is left to that
    parent). Any failure is ignored: a leftover empty folder is not worth a failed run."""
    try:
        finalizers = [f for f in list(util._finalizer_registry.values())
                      if getattr(f, "_callback", None) is util._remove_temp_dir]
        for finalizer in finalizers:
            # multiprocessing.util.Finalize: runs once, and only in the process that registered it
            finalizer()
    except Exception:  # noqa: BLE001 - a private API that may change: keep the folder rather than fail the exit
        pass
