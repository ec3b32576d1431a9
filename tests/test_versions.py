"""The supported torch and DeepSpeed versions (vim_ds/runtime/versions.py): a version too old is refused in one line
before anything starts, and setup.py's install bounds are the same minimums.

An older torch or DeepSpeed cannot be installed beside this venv's, so the run's refusal is exercised with
torch.__version__ patched (the attribute versions.installed reads); the refusal itself is a function of the version
strings, tested with them directly. tools/version_matrix.sh runs the supported versions for real (docs/versions.md).
"""
import argparse
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vim_ds import cli
from vim_ds.cli import run_options
from vim_ds.engine.run import run
from vim_ds.runtime import versions
from vim_ds.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TOO_OLD_TORCH = ("torch 2.3.1+cu121 is installed, and vim_ds supports torch >= 2.4 (tested: "
                 f"{versions.TESTED['torch']}, docs/versions.md); install a torch in that range")


def test_a_version_below_the_range_is_named_with_the_range():
    assert versions.problem({"torch": "2.3.1+cu121", "deepspeed": "0.19.8"}) == TOO_OLD_TORCH
    assert versions.problem({"torch": "2.14.1", "deepspeed": "0.15.4"}) == (
        f"deepspeed 0.15.4 is installed, and vim_ds supports deepspeed >= 0.16 (tested: "
        f"{versions.TESTED['deepspeed']}, docs/versions.md); install a deepspeed in that range")
    # a minor release's first patch, a newer major, a local build, DeepSpeed absent (its import says so later)
    for found in ({"torch": "2.4.0", "deepspeed": "0.16.0"}, {"torch": "3.0.0a0+git1234", "deepspeed": "1.0.0"},
                  {"torch": "2.10.0+rocm7.1", "deepspeed": None}):
        assert versions.problem(found) is None, found


def test_the_installed_versions_pass():
    assert versions.unsupported() is None, versions.installed()


def test_a_run_with_a_torch_too_old_stops_before_deepspeed_in_one_line(monkeypatch, capsys, tmp_path):
    """engine/run.py (each rank of a launcher) and `vim-ds` (every command): exit 2, the one line, nothing started.
    The negative control: the same run with the real version gets past the check, to the next refusal (its data)."""
    args = ["--data-path", str(tmp_path / "no_such_data"), "--output_dir", str(tmp_path / "out")]
    assert run(run_options.parse_config(args), "vim-ds train") == 2
    assert "no_such_data" in capsys.readouterr().err

    monkeypatch.setattr(torch, "__version__", "2.3.1+cu121")
    assert run(run_options.parse_config(args), "vim-ds train") == 2
    assert capsys.readouterr().err == f"vim-ds train: error (rank 0): {TOO_OLD_TORCH}\n"
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == f"vim-ds demo: error: {TOO_OLD_TORCH}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(versions.MINIMUM))
def test_setup_py_requires_the_same_minimum(name):
    minimum = ".".join(map(str, versions.MINIMUM[name]))
    assert re.search(rf'"{name}>={re.escape(minimum)}"', (ROOT / "setup.py").read_text()), name


def test_a_torch_without_custom_op_gets_the_one_line_not_a_traceback():
    """torch 2.3 has no torch.library.custom_op, with which the ops are registered at `import vim_ds`: the package
    imports without them, and `vim-ds` refuses that torch in one line. A torch 2.3 is made in a fresh process by
    taking custom_op away and setting its version (torch 2.3 itself cannot be installed beside this venv's)."""
    import subprocess
    import sys

    code = ("import sys, torch; del torch.library.custom_op; torch.__version__ = '2.3.1+cu121'\n"
            "from vim_ds import cli; sys.exit(cli.main(['train', '--data-path', 'x']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (proc.returncode, proc.stderr) == (2, f"vim-ds train: error: {TOO_OLD_TORCH}\n"), proc.stderr[-2000:]


def test_a_zero3_universal_copy_is_refused_where_deepspeed_converts_one_parameter_group(monkeypatch, tmp_path):
    """DeepSpeed before 0.18 re-partitions the first parameter group of a ZeRO-3 checkpoint only (vim_ds's optimizer
    has two): a resume on another rank count, or `vim-ds convert --universal`, is refused before the conversion
    starts, naming the way out; nothing is written. DeepSpeed's version is patched here (versions.installed: this
    venv has the newest); tools/version_matrix.sh meets the real 0.16.9, which failed half-way."""
    import json
    import os

    from vim_ds.checkpoint import deepspeed_dir as layout
    from vim_ds.checkpoint.files import CheckpointError
    from vim_ds.engine import checkpointing

    tag = tmp_path / "checkpoints" / "global_step5"
    tag.mkdir(parents=True)

    def saved_by(stage):
        (tag / layout.MARKER).write_text(json.dumps({"step": 5, "zero_stage": stage, "world_size": 2}))

    def with_deepspeed(version):
        monkeypatch.setattr(versions, "installed", lambda: {"torch": str(torch.__version__), "deepspeed": version})

    saved_by(3)
    with_deepspeed("0.16.9")
    with pytest.raises(CheckpointError) as info:
        checkpointing.universal_copy(str(tag.parent), "global_step5")
    assert str(info.value) == (
        f"cannot convert {tag} to a universal checkpoint: it was saved by ZeRO-3, and DeepSpeed 0.16.9's "
        f"ds_to_universal re-partitions only one parameter group of a ZeRO-3 checkpoint (DeepSpeed >= 0.18 all of "
        f"them); resume it on the 2 ranks that saved it, or install deepspeed>=0.18")
    assert os.listdir(tag.parent) == ["global_step5"]
    with_deepspeed("0.17.6")
    assert checkpointing.universal_refusal(str(tag)) is not None
    # what DeepSpeed converts: ZeRO-1/2 with any version, ZeRO-3 from 0.18 on
    with_deepspeed("0.18.9")
    assert checkpointing.universal_refusal(str(tag)) is None
    saved_by(2)
    with_deepspeed("0.16.9")
    assert checkpointing.universal_refusal(str(tag)) is None


def test_weights_only_loads_allow_their_types_for_the_block_where_torch_has_no_safe_globals(monkeypatch, tmp_path):
    """torch 2.4 has no torch.serialization.safe_globals (every resume, convert and universal copy stopped on it),
    only the process-wide allow-list: checkpoint.files.safe_globals adds the types for the block and puts the list
    back after it. torch 2.4 is made here by taking safe_globals away (the matrix runs the real one)."""
    import argparse

    from vim_ds.checkpoint import files

    path = tmp_path / "args.pt"
    torch.save({"args": argparse.Namespace(lr=0.1)}, path)
    before = set(map(repr, torch.serialization.get_safe_globals()))
    monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)  # (torch 2.4 has none)
    with pytest.raises(Exception, match="Unsupported global"):  # refused outside the block
        torch.load(path, weights_only=True)
    with files.safe_globals([argparse.Namespace]):
        assert torch.load(path, weights_only=True)["args"].lr == 0.1
    assert set(map(repr, torch.serialization.get_safe_globals())) == before  # (their order aside)
    assert files.load_weights_file(path)["args"].lr == 0.1  # through a loader of vim_ds's


def test_a_deepspeed_checkpoint_loads_where_the_allow_list_takes_no_named_pairs(monkeypatch, tmp_path):
    """torch 2.5 has safe_globals but its allow-list takes no `(object, "module.name")` pairs (safe_load's getattr
    of an enum member): it reads every entry's __module__ at the first global it looks up, so each resume, convert
    and universal copy failed with `'tuple' object has no attribute '__module__'`. The pairs are dropped where the
    allow-list cannot take them, found by trying one. torch 2.5's lookup is put in place here (it is three lines:
    each entry named by its __module__ and __name__); the matrix runs the real one."""
    from torch import _weights_only_unpickler as unpickler

    from vim_ds.checkpoint import files, safe_load

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, path)
    if tuple(map(int, re.findall(r"\d+", torch.__version__)[:2])) >= (2, 6):
        assert files._allow_list_takes_pairs()  # newer torch keeps the pairs
    def user_allowed_globals_of_torch25():  # (the list is read at each call: the `with` blocks replace it)
        marked = getattr(unpickler, "_marked_safe_globals_set", None) or unpickler._marked_safe_globals_list
        return {f"{entry.__module__}.{entry.__name__}": entry for entry in marked}

    monkeypatch.setattr(unpickler, "_get_user_allowed_globals", user_allowed_globals_of_torch25)
    monkeypatch.setattr(files, "_allow_list_takes_pairs", functools.cache(files._allow_list_takes_pairs.__wrapped__))
    assert not files._allow_list_takes_pairs()
    assert safe_load.load(str(path))["args"].lr == 0.1
    with safe_load.deepspeed_loads(str(tmp_path)):  # DeepSpeed's own loads
        assert torch.load(path, weights_only=False)["module"]["w"].tolist() == [1.0, 1.0]


# Rank 0 leaves an all-reduce waiting for rank 1 on the world group and on a group it keeps no reference to, drops
# their tensors and works (the gloo workers then hold the last references, and freeing them needs the GIL), and
# tears down; rank 1 joins both all-reduces 2 s later, while rank 0 is inside teardown.
TEARDOWN_RANKS = r"""
import os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

from vim_ds.runtime import distributed

rank, folder = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
subgroup = dist.new_group([0, 1])
if rank == 0:
    works = [dist.all_reduce(torch.ones(4), async_op=True),
             dist.all_reduce(torch.ones(4), group=subgroup, async_op=True)]
    del works, subgroup
    open(f"{folder}/issued", "w").close()
    distributed.teardown()
    print("torn down", flush=True)
    open(f"{folder}/torn_down", "w").close()
else:
    while not os.path.exists(f"{folder}/issued"):
        time.sleep(0.05)
    time.sleep(2)
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4), group=subgroup)
    deadline = time.time() + 60
    while not os.path.exists(f"{folder}/torn_down") and time.time() < deadline:
        time.sleep(0.05)
os._exit(0)
"""


def test_teardown_returns_while_gloo_workers_still_free_collectives(tmp_path):
    """torch 2.4 destroyed a process group with the GIL held, and its backend's destructor waits for the gloo
    workers, one of which needed the GIL to free a finished all-reduce: a rank hung at its exit after a finished
    2-rank run (matrix, torch 2.4.1). teardown holds each group's backend across destroy_process_group so that
    the backends are destroyed by their own bindings, which release the GIL (distributed._backends_of_every_group).
    Two real gloo ranks; torch 2.4 is needed for the hang (the matrix runs this test there)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    ranks = [subprocess.Popen([sys.executable, "-c", TEARDOWN_RANKS, str(rank), str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    # (torch 2.8 and 2.10's gloo print "[Gloo] Rank 0 is connected to 1 peer ranks..." on stdout before it)
    assert outputs[0][0].splitlines()[-1:] == ["torn down"], outputs


def test_a_deepspeed_016_checkpoint_with_a_set_loads_where_torch_allows_no_set_by_default(monkeypatch, tmp_path):
    """DeepSpeed 0.16's model states hold `sparse_tensor_module_names` as a set, which torch 2.4's weights-only
    unpickler does not allow by default (newer torch does): every resume, conversion and universal copy of such a
    checkpoint was refused as unsafe there. vim_ds's loads and DeepSpeed's own ones inside deepspeed_loads allow it.
    torch 2.4 is made here by taking set off torch's default allow-list (the matrix runs the real one)."""
    from torch import _weights_only_unpickler as unpickler

    from vim_ds.checkpoint import safe_load

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "sparse_tensor_module_names": {"embed"}}, path)
    allowed = unpickler._get_allowed_globals
    monkeypatch.setattr(unpickler, "_get_allowed_globals",
                        lambda: {name: obj for name, obj in allowed().items() if name != "builtins.set"})
    with pytest.raises(Exception, match="GLOBAL (builtins.)?set was not an allowed global"):  # torch 2.4's refusal
        torch.load(path, weights_only=True)
    assert safe_load.load(path)["sparse_tensor_module_names"] == {"embed"}
    # DeepSpeed's own loads (weights_only=False, forced to weights-only inside deepspeed_loads)
    with safe_load.deepspeed_loads(str(tmp_path)):
        assert torch.load(path, weights_only=False)["sparse_tensor_module_names"] == {"embed"}


# A world of one builds a real DeepSpeed engine whose optimizer is a BF16_Optimizer (bf16 with fp32 gradient
# accumulation: ZeRO-1 here, which every DeepSpeed in range gives it; DeepSpeed 0.16 also without ZeRO) through
# vim_ds, then does to each flat bf16 buffer what torch 2.4's gloo all-gather does after each step: views of it made
# under no_grad, written from another thread, where grad mode is on.
BF16_BUFFERS = r"""
import json, threading, types

import deepspeed
import torch

from vim_ds.runtime import deepspeed_engine, distributed

distributed.without_deepspeed_shm_op()  # as a vim_ds rank: no CPU shm all-reduce to build
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
# (torch's AdamW: DeepSpeed's fused one would be compiled first on a CPU; small buckets: the default ones hold 0.7 GB)
config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
          "zero_optimization": {"stage": 1, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
groups = [{"params": list(model.parameters())}]
engine, _, _ = deepspeed_engine.build(model, groups, types.SimpleNamespace(config=config), None, None)
errors = []
for flat in getattr(engine.optimizer, "bf16_groups_flat", []):
    with torch.no_grad():
        views = flat.chunk(1)
    def gather():
        try:
            views[0].copy_(torch.ones_like(views[0]))
        except RuntimeError as exc:
            errors.append(str(exc))
    worker = threading.Thread(target=gather)
    worker.start()
    worker.join()
# DeepSpeed 0.17 names its two bf16 wrappers alike ("bf16"), and the check for the ZeRO-0 one's comes first
from deepspeed.runtime import constants
routes = "BF16_Optimizer" if constants.BFLOAT16 != getattr(constants, "DDP_BFLOAT16", None) else "FP16_UnfusedOptimizer"
# ZeRO-1/2's optimizer, fp32 and bf16: what it all-gathers into after each step, and the partitions it gathers from
tracked = {}
for precision in ("fp32", "bf16"):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    zero2 = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": precision == "bf16"},
             "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    zero2_engine, _, _ = deepspeed_engine.build(model, [{"params": list(model.parameters())}],
                                                types.SimpleNamespace(config=zero2), None, None)
    opt = zero2_engine.optimizer
    buffers = list(opt.bit16_groups_flat) + [t for parts in opt.parallel_partitioned_bit16_groups for t in parts]
    tracked[precision] = [type(opt).__name__, len(buffers), sum(t.requires_grad for t in buffers)]
print("RESULT " + json.dumps({"optimizer": type(engine.optimizer).__name__, "routes": routes, "errors": errors,
                              "zero2": tracked}))
"""


def test_bf16_optimizer_buffers_take_a_gather_into_their_views_from_another_thread(tmp_path):
    """DeepSpeed's BF16_Optimizer flattened each group's bf16 parameters into a buffer that autograd recorded, and
    torch 2.4's gloo copies the all-gathered partitions into views of it in its worker thread: every multi-rank CPU
    run with bf16 and no ZeRO stopped at its first step on DeepSpeed 0.16 and torch 2.4 (`A view was created in
    no_grad mode and is being modified inplace with grad mode enabled`). vim_ds detaches those buffers after building
    the engine (deepspeed_engine.untrack_flat_buffers); the matrix runs the real 2-rank case there. DeepSpeed 0.17
    builds no BF16_Optimizer from any config (its wrapper constants BFLOAT16 and DDP_BFLOAT16 are both "bf16", so
    bf16 with fp32 accumulation goes to FP16_UnfusedOptimizer): there the test checks that routing, and that the
    engine has no flat bf16 buffers to gather into.

    ZeRO-1 and ZeRO-2 on DeepSpeed 0.18 (DeepSpeedZeroOptimizer, fp32 and bf16) flatten the parameters the same
    way (DeepSpeed PR #7828; 0.19 detaches them, PR #7948): every 2-rank CPU run with ZeRO-1 or 2 stopped at its
    first step on torch 2.4 (`Output 0 of SplitBackward0 is a view and is being modified inplace`, in gloo's
    all_gather_into_tensor), as the matrix found. vim_ds detaches the buffer and the partitions cut from it
    (deepspeed_engine.untrack_flat_buffers): nothing the optimizer gathers into or from may be recorded by autograd,
    on any version (a world of one does not gather, so the state is what is checked here; the matrix runs the
    2-rank runs)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", BF16_BUFFERS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, proc.stderr[-3000:]
    result = json.loads(results[0][len("RESULT "):])
    zero2 = result.pop("zero2")
    assert result == {"optimizer": result["routes"], "routes": result["routes"], "errors": []}, result
    # each engine: DeepSpeed's ZeRO-1/2 optimizer, its buffer and partition(s), none of them recorded by autograd
    assert all(name == "DeepSpeedZeroOptimizer" and count >= 2 and tracked == 0
               for name, count, tracked in zero2.values()), zero2


# A world of one builds real DeepSpeed engines without ZeRO in bf16 through vim_ds (an FP16_UnfusedOptimizer in every
# DeepSpeed from 0.17 on), takes two optimizer steps as the trainer does (its norm before each step, the stepped
# gradients dropped after it), with 1 and with 2 micro steps a step, and checks each step's gradients against the
# same backward made by hand on a copy of the module: the mean gradient of this step's micro batches only.
ZERO0_BF16 = r"""
import copy, json, types

import deepspeed
import torch

from vim_ds.engine import trainer
from vim_ds.runtime import deepspeed_engine, distributed

distributed.without_deepspeed_shm_op()  # as a vim_ds rank: no CPU shm all-reduce to build
deepspeed.init_distributed(dist_backend="gloo")
results = []
for stage, accum_dtype in ((0, None), (1, "fp32")):
    for accum in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        plain = copy.deepcopy(model).bfloat16()  # the module without the engine, for the backward by hand
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
                  "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        if accum_dtype:
            config["data_types"] = {"grad_accum_dtype": accum_dtype}
        groups = [{"params": list(model.parameters())}]
        engine, _, _ = deepspeed_engine.build(model, groups, types.SimpleNamespace(config=config), None, None)
        own = trainer._keeps_its_own_gradients(engine.optimizer)  # the trainer's choice of the norm's source
        batches = torch.Generator().manual_seed(1)
        for step in range(2):
            left = sum(p.grad is not None for p in engine.module.parameters())
            by_hand = copy.deepcopy(plain)
            by_hand.load_state_dict(engine.module.state_dict())  # this step's weights
            for micro in range(accum):  # as the trainer does: engine.step() after every micro step's backward
                x = torch.randn(4, 8, generator=batches).bfloat16()
                y = torch.randint(0, 4, (4,), generator=batches)
                engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
                (torch.nn.functional.cross_entropy(by_hand(x).float(), y) / accum).backward()
                if micro < accum - 1:
                    engine.step()  # not the accumulation's boundary: no update
            want = float(torch.stack([p.grad.float().norm() for p in by_hand.parameters()]).norm())
            module_norm = deepspeed_engine.module_grad_norm(engine)
            engine.step()  # the update
            got = float(engine.get_global_grad_norm()) if own else module_norm
            deepspeed_engine.drop_stepped_gradients(engine.module)
            results.append({"optimizer": type(engine.optimizer).__name__, "accum_dtype": accum_dtype, "own": own,
                            "accum": accum, "step": step, "left": left, "ratio": got / want,
                            "module_ratio": module_norm / want})
print("RESULT " + json.dumps(results))
"""


def test_zero0_bf16_steps_take_their_own_gradients_unscaled(tmp_path):
    """Without ZeRO, DeepSpeed 0.17 runs bf16 through FP16_UnfusedOptimizer with fp16's dynamic loss scale (65536)
    and does not clear the gradients after its step: each step's gradient was the sum of every earlier step's, so
    ZeRO-0's losses drifted 1.4 % from ZeRO-1/2/3's in 10 steps, and the trainer's ZeRO-0 norm was 65536 times too
    large (matrix, torch 2.4.1 + DeepSpeed 0.17.6). The trainer drops the stepped gradients and divides by the
    optimizer's loss scale (deepspeed_engine.drop_stepped_gradients, module_grad_norm); newer DeepSpeed clears them
    and scales bf16 by 1, where both change nothing. The variant: 2 micro steps a step (the stale gradient entered
    the first of them).

    DeepSpeed 0.16 runs bf16 without ZeRO through BF16_Optimizer instead (fp32 gradient accumulation, its default
    there), which moves each micro step's gradients into fp32 buffers of its own: the module's gradients are the
    last micro step's only, and the trainer's norm from them was 44 % low with 2 micro steps (the ZeRO stages'
    equivalence test failed on DeepSpeed 0.16). There the trainer takes the optimizer's own norm
    (trainer._keeps_its_own_gradients): it must be the full step's, and the module's must not be (the bug put back).
    Newer DeepSpeed builds BF16_Optimizer only for ZeRO-1 with `data_types.grad_accum_dtype` fp32 (0.17 not even
    there), the second variant, which checks the same on every version but 0.17. CI's oldest pair runs this test
    on DeepSpeed 0.16, the matrix on every minor."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", ZERO0_BF16], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, proc.stderr[-3000:]
    steps = json.loads(results[0][len("RESULT "):])
    assert [(s["accum_dtype"], s["accum"], s["step"]) for s in steps] == [
        (dtype, accum, step) for dtype in (None, "fp32") for accum in (1, 2) for step in (0, 1)], steps
    from deepspeed import __version__ as ds_version
    for s in steps:
        # nothing left from the step before; the same gradients up to bf16's rounding of the two sums
        assert s["left"] == 0 and abs(s["ratio"] - 1) < 1e-2, s
        # the optimizer that keeps the gradients itself is the one the trainer takes the norm from
        assert s["own"] == (s["optimizer"] == "BF16_Optimizer"), s
        assert s["optimizer"] in ("BF16_Optimizer", "FP16_UnfusedOptimizer"), s
        if s["own"] and s["accum"] == 2:
            assert abs(s["module_ratio"] - 1) > 0.1, s  # the module's norm: the last micro step's only
    # ZeRO-1 with fp32 accumulation: BF16_Optimizer but on DeepSpeed 0.17 (docs/versions.md); ZeRO-0: on 0.16 only
    assert all(s["own"] == (not ds_version.startswith("0.17.")) for s in steps if s["accum_dtype"]), steps
    assert all(s["own"] == ds_version.startswith("0.16.") for s in steps if not s["accum_dtype"]), steps


def _setup_functions(*names):
    """setup.py's functions `names`, compiled from its source (importing setup.py would run setup())."""
    import ast
    import shutil
    import subprocess

    tree = ast.parse((ROOT / "setup.py").read_text())
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace = {"os": os, "re": re, "shutil": shutil, "subprocess": subprocess}
    exec(compile(ast.Module(body=body, type_ignores=[]), "setup.py", "exec"), namespace)
    return [namespace[name] for name in names]


@pytest.mark.parametrize("nvcc,builds", [("13.0", False), ("12.4", True)])
def test_setup_builds_no_gpu_kernel_with_an_nvcc_of_another_major_version(tmp_path, monkeypatch, nvcc, builds):
    """A torch wheel built for CUDA 12.1 beside a system nvcc 13.0 (CI's image; a cluster's module): torch's
    extension build refuses another major version, so the README's install failed with the oldest torch. setup.py
    now leaves the GPU kernel out with one line saying why; an nvcc of the same major version still builds it."""
    from types import SimpleNamespace

    from torch.utils import cpp_extension

    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "bin" / "nvcc").write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc}, V{nvcc}.1'\n")
    (home / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    toolchain = _setup_functions("_gpu_toolchain", "_nvcc_release")[0]
    fake_torch = SimpleNamespace(version=SimpleNamespace(hip=None, cuda="12.1"))
    backend, reason = toolchain(fake_torch)
    if builds:
        assert backend == "cuda", reason
    else:
        assert backend is None and reason == (f"nvcc 13.0 in {home} and torch's CUDA 12.1 differ in their major "
                                              f"version (set CUDA_HOME to a CUDA 12 toolkit)")
