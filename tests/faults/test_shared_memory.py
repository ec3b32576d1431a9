"""A CPU run builds no DeepSpeed shared-memory all-reduce and leaves nothing in /dev/shm.

On CPU, `deepspeed.init_distributed` JIT-compiles DeepSpeed's `deepspeed_shm_comm` op (40-100 CPU-seconds on a first
run) and, when all ranks share a host, makes each rank write a 69 MB file
`/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>` it never unlinks: RAM that stays taken after the job
(a day of this suite once left 18 GB on a 24 GB machine). The op serves only `inference_all_reduce`; a vim_ds rank
marks it not to be built (vim_ds.runtime.distributed.without_deepspeed_shm_op), and `inference_all_reduce` falls back
to the process group. The run below goes through the real deepspeed launcher (which sets the LOCAL_SIZE the op
would need). Control, run by hand rather than in the suite (it costs the op's build): the same script calling
`deepspeed.init_distributed` alone prints `shm_op=True` on both ranks and leaves both files (2026-11-29).
"""
from __future__ import annotations

import glob
import os
import subprocess

import pytest

from train_utils import ROOT, _free_port, train_env
from vim_ds.runtime.build_tools import extensions_dir_per_install

pytestmark = pytest.mark.slow

RANK_SCRIPT = """\
import os, sys, torch
if sys.argv[-1] == "vim_ds":  # the deepspeed launcher puts --local_rank=N first
    from vim_ds.runtime.distributed import setup
    unset = "TORCH_EXTENSIONS_DIR" not in os.environ
    rank = setup().rank
    print(f"rank {rank} ops in {os.environ.get('TORCH_EXTENSIONS_DIR')} (unset before: {unset})", flush=True)
else:  # the control: DeepSpeed alone
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    rank = int(os.environ["RANK"])
import deepspeed.comm as dscomm
from deepspeed.comm import comm
t = torch.full((1000,), float(rank + 1))
dscomm.inference_all_reduce(t)
print(f"rank {rank} shm_op={comm.cdb.shm_comm_op is not None} sum={t.sum().item()}", flush=True)
"""


def run_ranks(tmp_path, mode: str, env: dict) -> tuple[str, list[str]]:
    """The script on 2 ranks under the deepspeed launcher: its output, and the /dev/shm files left by the run."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = _free_port()
    pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    try:
        proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), str(script), mode],
                              capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout, sorted(os.path.basename(f) for f in glob.glob(pattern))
    finally:
        for leftover in glob.glob(pattern):
            os.unlink(leftover)


def test_a_cpu_run_builds_no_shm_op_and_leaves_nothing_in_dev_shm(tmp_path):
    """And, with TORCH_EXTENSIONS_DIR unset, vim_ds's ranks put DeepSpeed's JIT builds (cpu_adam) in the folder of
    this torch and DeepSpeed installation (vim_ds.runtime.build_tools.extensions_dir_per_install), the suite's."""
    env = {k: v for k, v in train_env().items() if k != "TORCH_EXTENSIONS_DIR"}
    out, left = run_ranks(tmp_path, "vim_ds", env)
    folder = extensions_dir_per_install({})  # where tests/conftest.py sent the suite's own builds
    for rank in (0, 1):
        assert f"rank {rank} ops in {folder} (unset before: True)" in out, out[-2000:]
        # the all-reduce is still a sum over both ranks (1000 x (1 + 2)), through the process group
        assert f"rank {rank} shm_op=False sum=3000.0" in out, out[-2000:]
    assert left == []
