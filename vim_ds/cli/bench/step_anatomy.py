"""`vim-ds bench anatomy`: a training step of a Vim model on paper, op by op, without a GPU (issue 51).

One forward and backward of the model at the training shape (batch, image size, precision) is traced on the meta
device (shapes and dtypes only, nothing allocated, no GPU needed), and each operator it runs is put beside its
roofline on a modelled GPU. Where a GPU runs one fused kernel that the meta device decomposes, the trace takes the
kernel: ``F.rms_norm`` is ``aten::_fused_rms_norm`` forward and ``_fused_rms_norm_backward`` on CUDA and ROCm (the
model calls it only where torch has them). Per operator:

- its bytes: every tensor it reads and writes, as an unfused kernel moves them (views move nothing);
- its FLOPs: matrix products (``torch.utils.flop_counter``'s formulas) at the dtype's dense matrix peak
  (``scan_model.BF16_MATMUL_FLOPS``; FP32 otherwise);
- Vim's own ops (``vim_ds::bimamba_branch_fwd`` / ``_bwd``, ``ssm_branch_*``): what ``ops/library.py`` runs
  inside them on a GPU, each part as its own kernel: the scan at the performance model's bound (``scan_model``),
  the conv, the projections and the copies by their bytes and FLOPs (``branch_parts``);
- the optimizer step: AdamW over the parameters, fp32 master weights, moments and the gradient (DeepSpeed's fused
  Adam moves 28 bytes a parameter: bf16 gradient, fp32 master, m, v read and written, bf16 weight written).

The sum is the least time a step can take with each operator its own kernel at its roofline: what a profile's
times (`vim-ds bench profile`) stand against, and which unfused traffic is worth fusing (issue 51, item 5).
It leaves out everything that is not an operator's own work: launches, the data loader, DeepSpeed's bookkeeping,
communication.
"""
from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass

import torch
from timm.loss import SoftTargetCrossEntropy
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...config.ds_config import DEFAULT_MICRO_BATCH
from ...models.factory import ModelConfig
from ..run_options import add_model_kwargs
from . import scan_model

# What an operator is, for the table by kind; the same kinds for a traced op (`aten.add.Tensor`) and for a profiled
# one (`aten::add`), by the op's base name. A GPU profile gives a kernel's time to the innermost operator that
# launched it, so the fused branch ops own their scan and conv kernels, and the projections and copies inside them
# are matrix products and copies there: here too (branch_parts).
BRANCH_KIND = "Vim's branch kernels (scan, conv)"
OPTIMIZER_KIND = "optimizer (AdamW)"
KINDS = ("matrix products", BRANCH_KIND, "norms", "elementwise", "reductions", "casts and copies", OPTIMIZER_KIND)
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward", "_convolution"}
NORMS = {"_fused_rms_norm", "_fused_rms_norm_backward", "native_layer_norm", "native_layer_norm_backward",
         "add_rms_norm_fwd", "add_rms_norm_bwd"}  # (the last two: Vim's blocks' residual add and RMSNorm, fused)
REDUCTIONS = {"sum", "mean", "amax", "max", "_log_softmax", "_softmax", "_log_softmax_backward_data",
              "_softmax_backward_data"}
COPIES = {"_to_copy", "copy_", "clone", "cat", "slice_backward", "select_backward", "contiguous", "constant_pad_nd",
          "index_put_", "new_zeros", "zeros", "zeros_like", "ones_like", "fill_", "zero_"}
# Operators that only make a view or read a tensor's metadata, or allocate without writing: no bytes.
NO_TRAFFIC = {"view", "_unsafe_view", "transpose", "t", "expand", "permute", "split", "split_with_sizes", "slice",
              "select", "detach", "alias", "unsqueeze", "squeeze", "as_strided", "unbind", "empty", "empty_strided",
              "new_empty", "new_empty_strided", "empty_like", "promote_types", "lift_fresh", "is_same_size",
              "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
              "resolve_conj", "resolve_neg"}
# Operators that read none of their tensor arguments, only their shape or dtype: they write their output alone.
WRITE_ONLY = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "fill_", "zero_",
              "zeros", "ones", "full", "rand_like", "randn_like", "bernoulli_", "uniform_", "normal_"}
# the fused branch ops -> (backward, directions)
BRANCH_OPS = {"vim_ds.ssm_branch_fwd.default": (False, 1), "vim_ds.ssm_branch_bwd.default": (True, 1),
              "vim_ds.bimamba_branch_fwd.default": (False, 2), "vim_ds.bimamba_branch_bwd.default": (True, 2)}
ADAM_BYTES_PER_PARAM = 28


@dataclass
class Op:
    name: str
    kind: str
    bytes: float
    flops: float
    seconds: float  # at its roofline
    shape: tuple


def _tensors(x) -> list:
    """The tensors among an op's arguments or results, however nested."""
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def footprint(t: torch.Tensor) -> int:
    """The bytes of the distinct elements a tensor holds: an expanded one (stride 0: a weight broadcast over the
    batch of a bmm) is read from memory once, not once a batch entry."""
    return t.element_size() * math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) if t.numel() else 0


def branch_parts(batch, dim, seqlen, d_state, dt_rank, dtype, backward):
    """[(part, kind, bytes, flops, scan KernelCost or None)] of one fused branch op (`ops/library.py`, GPU
    backend): the conv (SiLU fused), x_proj and dt_proj, the B and C copies, the scan; the backward recomputes the
    forward's inputs to the scan, then runs the scan's backward, the projections' gradients and the conv's
    backward. The projections are matrix products (aten::bmm and baddbmm inside the op), the copies copies."""
    e = scan_model.ELEM_BYTES[dtype]
    bdl, bnl, rows = batch * dim * seqlen, batch * d_state * seqlen, dt_rank + 2 * d_state
    dbl = batch * rows * seqlen
    mat, copies = "matrix products", "casts and copies"
    fwd_inputs = [("conv + SiLU", BRANCH_KIND, 2 * bdl * e, 0, None),                           # x -> u
                  ("x_proj", mat, (bdl + dbl) * e, 2 * bdl * rows, None),                       # u -> x_dbl
                  ("dt_proj", mat, (batch * dt_rank * seqlen + bdl) * e, 2 * bdl * dt_rank, None),  # -> delta
                  ("B, C copies", copies, 4 * bnl * e, 0, None)]
    if not backward:
        return fwd_inputs + [("scan", BRANCH_KIND, 0, 0, scan_model.forward_cost(batch, dim, seqlen, d_state, dtype))]
    return [(f"{name} (recomputed)", *rest) for name, *rest in fwd_inputs] + [
        ("scan backward", BRANCH_KIND, 0, 0, scan_model.backward_cost(batch, dim, seqlen, d_state, dtype)),
        ("dt_proj gradients", mat, (2 * bdl + 2 * batch * dt_rank * seqlen) * e, 4 * bdl * dt_rank, None),
        ("dx_dbl (cat)", copies, 2 * dbl * e, 0, None),
        ("x_proj gradients", mat, (2 * bdl + 2 * dbl + bdl) * e, 4 * bdl * rows, None),  # dW; du += W^T dx_dbl
        ("conv + SiLU backward", BRANCH_KIND, 3 * bdl * e, 0, None)]                     # x, du -> dx


def _matmul_rate(gpu, dtype: torch.dtype) -> float:
    if dtype in (torch.bfloat16, torch.float16):
        return scan_model.BF16_MATMUL_FLOPS[gpu.name]
    return gpu.fp32_flops


def classify(name: str) -> str | None:
    """The kind of an operator, traced (`aten.add.Tensor`) or profiled (`aten::add`), or None for one that moves
    no bytes; Vim's ops (`vim_ds::...`) are the branch's kernels, but for its norms."""
    namespace, _, rest = name.replace("::", ".", 1).partition(".")
    base = rest.split(".")[0]
    if namespace == "vim_ds":
        return "norms" if base in NORMS else BRANCH_KIND
    if base in NO_TRAFFIC:
        return None
    for kind, names in (("matrix products", MATMULS), ("norms", NORMS), ("reductions", REDUCTIONS),
                        ("casts and copies", COPIES)):
        if base in names:
            return kind
    return "elementwise"


def _flops(func, args, kwargs, out) -> float:
    """A matrix product's FLOPs by torch's own formulas (those FlopCounterMode counts with)."""
    count = getattr(flop_counter, "flop_registry", {}).get(getattr(func, "overloadpacket", func))
    return 0.0 if count is None else float(count(*args, **(kwargs or {}), out_val=out))


def trace(model: torch.nn.Module, batch: int, image_size: int, precision: str, gpu) -> list[Op]:
    """The ops of one forward and backward of `model` (built on the meta device) at `batch` images of
    `image_size` with `precision` (bf16: weights and images in bfloat16, as DeepSpeed's bf16 runs; or fp32), each
    at its roofline on `gpu`, then the optimizer step. (Autocast has no meta device: not traced.)"""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    scan_dtype = "bfloat16" if precision == "bf16" else "float32"
    ops: list[Op] = []

    def record(name, kind, ins, outs, flops=0.0):
        if name.split(".")[1] in WRITE_ONLY:
            ins = []
        nbytes = sum(footprint(t) for t in ins + outs)
        if nbytes == 0:  # (an empty tensor's fill)
            return
        rate = _matmul_rate(gpu, ins[0].dtype if ins else dtype)
        ops.append(Op(name, kind, nbytes, flops, max(nbytes / gpu.hbm_bytes_per_s, flops / rate),
                      tuple(outs[0].shape) if outs else ()))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if name in BRANCH_OPS:
                ops.extend(_branch_ops(name, args, scan_dtype, gpu))
            elif (kind := classify(name)) is not None:
                record(name, kind, _tensors([args, kwargs or {}]), _tensors(out),
                       _flops(func, args, kwargs, out) if kind == "matrix products" else 0.0)
            return out

    class FusedNorms(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.rms_norm:
                call = dict(zip(("input", "normalized_shape", "weight", "eps"), args), **(kwargs or {}))
                return _FusedRmsNorm.apply(call["input"], call["normalized_shape"], call.get("weight"),
                                           call.get("eps"), record)
            return func(*args, **(kwargs or {}))

    n_params = sum(p.numel() for p in model.parameters())
    state = {n: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                            device="meta").requires_grad_(isinstance(t, torch.nn.Parameter) and t.requires_grad)
             for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    images = torch.empty(batch, 3, image_size, image_size, device="meta", dtype=dtype)
    targets = torch.empty(batch, max(int(getattr(model, "num_classes", 0) or 0), 1), device="meta")
    with Record(), FusedNorms():
        logits = torch.func.functional_call(model, state, (images,))
        SoftTargetCrossEntropy()(logits.float(), targets).backward()
    adam = n_params * ADAM_BYTES_PER_PARAM
    ops.append(Op("AdamW step (fused, analytic)", OPTIMIZER_KIND, adam, 0.0, adam / gpu.hbm_bytes_per_s,
                  (n_params,)))
    return ops


class _FusedRmsNorm(torch.autograd.Function):
    """F.rms_norm as the GPU runs it: one kernel forward (x, weight -> y and the rows' rstd in fp32), one backward
    (dy, x, rstd, weight -> dx, dweight), recorded as such."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps, record):
        rows = x.numel() // max(weight.numel(), 1)
        y, rstd = torch.empty_like(x), x.new_empty((rows,), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        ctx.record = record
        record("aten._fused_rms_norm", "norms", [x, weight], [y, rstd])
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.empty_like(x), torch.empty_like(weight)
        ctx.record("aten._fused_rms_norm_backward", "norms", [dy, x, rstd, weight], [dx, dw])
        return dx, None, dw, None, None


def _branch_ops(name: str, args, scan_dtype: str, gpu) -> list[Op]:
    """One fused branch op's parts (branch_parts) as ops: ssm_branch_fwd(x, z, conv_w, conv_b, x_proj_w, dt_proj_w,
    A, ...) and ssm_branch_bwd(dout, x, ...); bimamba_branch_fwd / _bwd the same for each of the two directions,
    and the second direction's adds into the first's out (forward) and dx (backward), a read of each in the store
    that writes it, and into dz (backward), an add of its own."""
    backward, directions = BRANCH_OPS[name]
    x, dt_proj_w, A = args[backward], args[backward + 5], args[backward + 6]
    batch, dim, seqlen = x.shape
    parts = branch_parts(batch, dim, seqlen, A.shape[1], dt_proj_w.shape[1], scan_dtype, backward) * directions
    if directions == 2:
        bdl_bytes = batch * dim * seqlen * scan_model.ELEM_BYTES[scan_dtype]
        summed = "the conv's dx" if backward else "out"
        parts.append((f"the directions' sum ({summed} read back)", BRANCH_KIND, bdl_bytes, 0, None))
        if backward:
            parts.append(("the directions' dz summed", "elementwise", 3 * bdl_bytes, 0, None))
    ops = []
    for part, kind, nbytes, flops, scan in parts:
        if scan is not None:
            nbytes, seconds = scan.bytes, scan.bound(gpu)["seconds"]
        else:
            seconds = max(nbytes / gpu.hbm_bytes_per_s, flops / _matmul_rate(gpu, x.dtype))
        ops.append(Op(f"{name.rsplit('.', 1)[0]}: {part}", kind, nbytes, flops, seconds, tuple(x.shape)))
    return ops


class AnatomyError(ValueError):
    """An unknown model or GPU, or a shape the model refuses (one line; `vim-ds bench` exits 2)."""


def anatomy(model_name: str, batch: int, image_size: int, precision: str, gpu_name: str, model_kwargs=None,
            top: int = 15) -> dict:
    """The step on paper: the ops by kind, the costliest ops (by name and output shape), the total. The model as a
    run builds it (ModelConfig; `num_classes` among `model_kwargs`, 1000 unless given), its published stochastic
    depth on."""
    gpus = {g.name: g for g in scan_model.GPUS}
    if gpu_name not in gpus:
        raise AnatomyError(f"--gpu must be one of {', '.join(gpus)}, got {gpu_name!r}")
    gpu = gpus[gpu_name]
    if "img_size" in (model_kwargs or {}):
        raise AnatomyError("give the image size as --input-size, not as img_size= in --model-kwargs")
    kwargs = dict(model_kwargs or {})
    num_classes = int(kwargs.pop("num_classes", 1000))
    with torch.device("meta"):
        model = ModelConfig(model_name, num_classes, image_size, kwargs, drop=None, drop_path=None).build()
    model.train()
    ops = trace(model, batch, image_size, precision, gpu)
    total = sum(o.seconds for o in ops)
    kinds = []
    for kind in KINDS:
        mine = [o for o in ops if o.kind == kind]
        if mine:
            seconds = sum(o.seconds for o in mine)
            kinds.append({"kind": kind, "ops": len(mine), "GB": sum(o.bytes for o in mine) / 1e9,
                          "GFLOP": sum(o.flops for o in mine) / 1e9, "ms": seconds * 1e3, "share": seconds / total})
    by_op = collections.defaultdict(lambda: {"calls": 0, "GB": 0.0, "ms": 0.0})
    for o in ops:
        row = by_op[(o.name, o.shape)]
        row["calls"] += 1
        row["GB"] += o.bytes / 1e9
        row["ms"] += o.seconds * 1e3
    costliest = sorted(({"op": name, "shape": list(shape), **row} for (name, shape), row in by_op.items()),
                       key=lambda r: -r["ms"])[:top]
    return {"settings": dict(model=model_name, model_kwargs=dict(model_kwargs or {}), batch=batch,
                             input_size=image_size, precision=precision, gpu=gpu.name,
                             hbm_TB_per_s=gpu.hbm_bytes_per_s / 1e12,
                             matrix_TFLOPS=_matmul_rate(gpu, torch.bfloat16 if precision == "bf16"
                                                        else torch.float32) / 1e12),
            "kinds": kinds, "costliest": costliest, "total_ms": total * 1e3,
            "images_per_s": batch / total, "ops": len(ops)}


def report(result: dict) -> str:
    s = result["settings"]
    kwargs = "".join(f" {k}={v}" for k, v in s["model_kwargs"].items())
    lines = [f"A training step of {s['model']}{kwargs} on paper: batch {s['batch']} at {s['input_size']} px, "
             f"{s['precision']}, each operator its own kernel at its roofline on one {s['gpu']} "
             f"({s['hbm_TB_per_s']:g} TB/s, {s['matrix_TFLOPS']:g} TFLOPS for matrix products):", "",
             "| kind | ops | GB | GFLOP | roofline ms | share |", "|---|---|---|---|---|---|"]
    for k in result["kinds"]:
        lines.append(f"| {k['kind']} | {k['ops']} | {k['GB']:.2f} | {k['GFLOP']:.0f} | {k['ms']:.2f} | "
                     f"{100 * k['share']:.1f} % |")
    lines += [f"| total | {result['ops']} | {sum(k['GB'] for k in result['kinds']):.2f} | "
              f"{sum(k['GFLOP'] for k in result['kinds']):.0f} | {result['total_ms']:.2f} | 100 % |", "",
              f"At most {result['images_per_s']:.0f} images/s on one {s['gpu']} ({s['batch']} images / "
              f"{result['total_ms']:.2f} ms): kernel launches, the data loader, DeepSpeed's own work and "
              f"communication left out, the scan at its bound (its kernel's measured / bound: `vim-ds bench scan "
              f"--predict`).", "", "The costliest operators (by name and output shape):", "",
              "| op | output shape | calls | GB | roofline ms |", "|---|---|---|---|---|"]
    for r in result["costliest"]:
        lines.append(f"| `{r['op']}` | {'x'.join(map(str, r['shape']))} | {r['calls']} | {r['GB']:.2f} | "
                     f"{r['ms']:.2f} |")
    return "\n".join(lines) + "\n"


def add_parser(sub) -> None:
    a = sub.add_parser("anatomy", help="a training step on paper: each operator beside its roofline, no GPU needed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--model", default="vim_small_s8")
    add_model_kwargs(a, default=[], help="model constructor overrides, e.g. depth=2 embed_dim=32")
    a.add_argument("--batch-size", type=int, default=DEFAULT_MICRO_BATCH,
                   help=f"images a step (one GPU's micro batch) [{DEFAULT_MICRO_BATCH}]")
    a.add_argument("--input-size", type=int, default=224)
    a.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: weights and activations in bfloat16 (DeepSpeed's bf16) [bf16]")
    a.add_argument("--gpu", default="H200 SXM",
                   help=f"the roofline's GPU: {', '.join(g.name for g in scan_model.GPUS)} [H200 SXM]")
    a.add_argument("--top", type=int, default=15, help="costliest operators listed")
    a.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    a.set_defaults(run=run_anatomy, check=check_args)


def check_args(parser, args) -> None:
    if args.batch_size < 1 or args.input_size < 1 or args.top < 0:
        parser.error("--batch-size and --input-size must be positive, --top at least 0")


def run_anatomy(args) -> dict:
    result = anatomy(args.model, args.batch_size, args.input_size, args.precision, args.gpu,
                     dict(args.model_kwargs), args.top)
    print(report(result))
    return result
