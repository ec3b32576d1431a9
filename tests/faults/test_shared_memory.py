"""A CPU run under the deepspeed launcher leaves nothing behind in /dev/shm (2 ranks, and 1: it makes its file too).

DeepSpeed's CPU communication op (built by every `deepspeed.init_distributed` on CPU) makes each rank write a 69 MB
file `/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>` when all ranks share a host, and never unlinks
it: RAM that stays taken after the job (a day of this suite left 18 GB on a 24 GB machine). vim_ds removes the names
once every rank has mapped its peers' buffers (vim_ds.runtime.distributed). Both runs below go through the deepspeed
launcher, which sets the LOCAL_SIZE the op needs; the control calls `deepspeed.init_distributed` alone and must leave
both files, so the check can see the leak. The op must still work after the names are gone (its mappings outlive
them): `inference_all_reduce` sums across the ranks.
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
    ops = os.environ.get("TORCH_EXTENSIONS_DIR")
    built = bool(ops) and os.path.exists(os.path.join(ops, "deepspeed_shm_comm", "deepspeed_shm_comm.so"))
    print(f"rank {rank} ops in {ops} (unset before: {unset}, shm op built there: {built})", flush=True)
else:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    rank = int(os.environ["RANK"])
import deepspeed.comm as dscomm
from deepspeed.comm import comm
t = torch.full((1000,), float(rank + 1))
dscomm.inference_all_reduce(t)
print(f"rank {rank} shm_op={comm.cdb.shm_comm_op is not None} sum={t.sum().item()}", flush=True)
"""


def _run(tmp_path, mode: str, ranks: int = 2, env=None) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = _free_port()
    pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    try:
        proc = subprocess.run(["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port), str(script), mode],
                              capture_output=True, text=True, timeout=300, env=env or train_env(), cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        total = float(sum(range(1, ranks + 1)) * 1000)
        for rank in range(ranks):
            assert f"rank {rank} shm_op=True sum={total}" in proc.stdout, proc.stdout[-2000:]
        if mode == "vim_ds" and env is not None and "TORCH_EXTENSIONS_DIR" not in env:
            folder = extensions_dir_per_install({})  # where tests/conftest.py sent the suite's own builds
            for rank in range(ranks):
                assert f"rank {rank} ops in {folder} (unset before: True, shm op built there: True)" in proc.stdout, \
                    proc.stdout[-2000:]
        return sorted(os.path.basename(f) for f in glob.glob(pattern))
    finally:
        for leftover in glob.glob(pattern):
            os.unlink(leftover)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_cpu_run_leaves_no_deepspeed_buffer_in_dev_shm(tmp_path, ranks):
    """And, with TORCH_EXTENSIONS_DIR unset, vim_ds's ranks build DeepSpeed's ops in the folder of this torch and
    DeepSpeed installation (vim_ds.runtime.build_tools.extensions_dir_per_install), the one the suite uses."""
    env = {k: v for k, v in train_env().items() if k != "TORCH_EXTENSIONS_DIR"}
    assert _run(tmp_path, "vim_ds", ranks, env) == []


def test_control_deepspeed_alone_leaves_one_buffer_per_rank(tmp_path):
    left = _run(tmp_path, "deepspeed")
    assert len(left) == 2 and left[0].endswith("_0") and left[1].endswith("_1"), left
