"""The selective-scan backends behind one small interface, and the choice between them: ours (``ref``, ``cpu``,
``cuda``) and, when it is installed, mamba_ssm's CUDA kernel (``mamba``, never chosen unless asked for).

Every backend has ``fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse=False,
return_last_state=False) -> (out, saved, last_state or None)`` and ``bwd(u, delta, A, B, C, D, z, delta_bias, dout,
saved, delta_softplus, reverse=False) -> 8 gradients`` (see csrc/README.md); ``reverse`` scans from the last time
step to the first, in place; ``last_state`` is the state after the last scan step, (batch, dim, d_state) in A's
dtype.

Backends that can start from a given state also have ``fwd_state(u, delta, A, B, C, D, z, delta_bias,
delta_softplus, reverse, h0) -> (out, saved, last_state)`` and ``bwd_state(u, delta, A, B, C, D, z, delta_bias,
dout, saved, delta_softplus, reverse, h0, dlast) -> 9 gradients`` (the 8 above, then dh0, None when h0 is None):
``h0`` (batch, dim, d_state) in A's dtype, the state before the first scan step (None: zero); ``dlast`` the
gradient of the returned last state (None: zero). With them comes ``h0_grad(u, delta, A, B, C, z, delta_bias, dout,
saved, delta_softplus, reverse, h0) -> dh0``: bwd_state's dh0 for dlast None, alone (it depends on neither h0 nor u
nor B; both kernels have a pass for it at about the forward's cost, the reference runs bwd_state), and
``decay_product(delta, A, delta_bias, delta_softplus) -> P``, the product of a chunk's decays (``scan_chunks``; the
CPU kernel sums softplus(delta + bias) with its own vectorised softplus, PyTorch's float32 one being several times
slower than a scan pass on the CPU). Ours (``ref``, ``cpu``, ``cuda``) have them (``vim_ds/ops/scan_state.py`` and
the sequence split use them); mamba_ssm's kernel does not.

The compiled kernels come from the extensions that setup.py builds (``vim_ds._scan_cpu``, ``vim_ds._scan_cuda``).
When one is missing (an install with the build skipped, a broken toolchain) it is JIT-compiled at first use from
the shipped sources, as DeepSpeed does with its ops; if that fails too, the pure-PyTorch ``ref`` backend is used and
says so once, with the reason.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import build_config
from .scan_chunks import decay_product
from .selective_scan_ref import selective_scan_ref

log = logging.getLogger("vim_ds")

BACKENDS = ("ref", "cpu", "cuda", "mamba")
ENV_BACKEND = "VIM_DS_SCAN"  # ref|cpu|cuda|mamba: force a backend
# mamba_ssm's compiled kernel (pip install mamba-ssm, on a CUDA machine)
MAMBA_MODULE = "selective_scan_cuda"
MAMBA_CHUNK = 2048  # mamba_ssm's kernel keeps one (decay, state) pair per state and per 2048 steps
ENV_JIT = "VIM_DS_JIT"  # 0: never JIT-build a missing kernel
# sse2|avx2|avx512 (x86-64): the CPU kernel's variant; default: the widest
ENV_CPU_ISA = "VIM_DS_CPU_ISA"


# Inside a registered op's implementation the dispatcher has switched autograd off (its keys are excluded), so the
# reference's gradients, which come from autograd, need them switched back on there.
_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))


def _autograd_recording():
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS)


def _state_or_zero(h0, u, A):
    """h0, or the zero state it stands for (bwd_state returns dh0 only when given one)."""
    return u.new_zeros((u.shape[0], u.shape[1], A.shape[1]), dtype=A.dtype) if h0 is None else h0


class RefBackend:
    """Pure PyTorch: the recurrence step by step, gradients by autograd (recomputed in bwd)."""

    name = "ref"

    def fwd(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse=False, return_last_state=False):
        with torch.no_grad():
            out, last = selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, True,
                                           reverse=reverse)
        return out, None, last if return_last_state else None

    def bwd(self, u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse=False):
        return self.bwd_state(u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse, None,
                              None)[:8]

    def fwd_state(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse, h0):
        with torch.no_grad():
            out, last = selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, True,
                                           reverse=reverse, h0=h0)
        return out, None, last

    def bwd_state(self, u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse, h0, dlast):
        args = [u, delta, A, B, C, D, z, delta_bias, h0]
        leaves = [None if a is None else a.detach().requires_grad_(True) for a in args]
        with _autograd_recording(), torch.enable_grad():
            out, last = selective_scan_ref(*leaves[:8], delta_softplus=delta_softplus, return_last_state=True,
                                           reverse=reverse, h0=leaves[8])
            present = [a for a in leaves if a is not None]
            outputs, cotangents = [out], [dout]
            # the last state's gradient, when it has one, joins the output's
            if dlast is not None:
                outputs.append(last)
                cotangents.append(dlast.to(last.dtype))
            grads = iter(torch.autograd.grad(outputs, present, cotangents, allow_unused=True))
        grads = [None if a is None else next(grads) for a in leaves]
        # an input that the outputs do not reach (autograd gives None) gets zeros
        return [g if g is not None or a is None else torch.zeros_like(a) for g, a in zip(grads, leaves)]

    def h0_grad(self, u, delta, A, B, C, z, delta_bias, dout, saved, delta_softplus, reverse, h0):
        return self.bwd_state(u, delta, A, B, C, None, z, delta_bias, dout, saved, delta_softplus, reverse,
                              _state_or_zero(h0, u, A), None)[8]

    def decay_product(self, delta, A, delta_bias, delta_softplus):
        return decay_product(delta, A, delta_bias, delta_softplus)


class ExtensionBackend:
    """A compiled kernel module exporting fwd/bwd."""

    def __init__(self, name, module):
        self.name = name
        self.module = module

    @property
    def adds_into(self) -> bool:
        """Whether the kernels add into an output they are given (the GPU kernel's scan forward `add_to` and conv
        backward `dx_add_to`: ScanArgs::accumulate, ConvArgs::accumulate) instead of writing a new one."""
        return self.name == "cuda"

    def fwd(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse=False, return_last_state=False,
            add_to=None):
        # Both kernels write the final state from their registers (the GPU kernel: its last segment's pass).
        into = {} if add_to is None else {"add_to": add_to}  # (adds_into backends only)
        out, saved, last = self.module.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse,
                                           return_last_state, **into)
        return out, saved, last

    def bwd(self, u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse=False):
        return list(self.module.bwd(u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse))

    def fwd_state(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse, h0):
        return self.module.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse, True, h0)

    def bwd_state(self, u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse, h0, dlast):
        grads = list(self.module.bwd(u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse, h0,
                                     dlast))
        return grads if h0 is not None else grads + [None]

    def h0_grad(self, u, delta, A, B, C, z, delta_bias, dout, saved, delta_softplus, reverse, h0):
        if hasattr(self.module, "h0_grad"):  # the kernel's own reverse pass
            return self.module.h0_grad(u, delta, A, B, C, z, delta_bias, dout, delta_softplus, reverse)
        return self.bwd_state(u, delta, A, B, C, None, z, delta_bias, dout, saved, delta_softplus, reverse,
                              _state_or_zero(h0, u, A), None)[8]

    def decay_product(self, delta, A, delta_bias, delta_softplus):
        if hasattr(self.module, "delta_sum"):  # the CPU kernel's softplus and sum
            return torch.exp(self.module.delta_sum(delta, delta_bias, delta_softplus).unsqueeze(-1) * A)
        return decay_product(delta, A, delta_bias, delta_softplus)


class MambaBackend:
    """mamba_ssm's kernel (its ``selective_scan_cuda`` extension) behind our ``fwd``/``bwd`` interface, to run the
    model or a benchmark on it side by side with ours. Not a dependency: only used when asked for
    (``VIM_DS_SCAN=mamba``, ``backend="mamba"``, ``vim-ds bench scan --mamba``).

    Its calls, as mamba_ssm's ``selective_scan_interface.py`` makes them:
    ``fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus) -> [out, x] (+ [out_z] with z)``, where B and C are
    4-D (batch, groups, d_state, seqlen), ``out`` is the result before the gate, ``out_z`` after it, and ``x``
    (batch, dim, n_chunks, 2 * d_state) in A's dtype holds a (decay, state) pair per state at the end of every
    2048-step chunk (so ``x[:, :, -1, 1::2]`` is the last state); ``bwd(u, delta, A, B, C, D, z, delta_bias, dout,
    x, out, dz, delta_softplus, recompute_out_z) -> [du, ddelta, dA, dB, dC, dD, ddelta_bias] (+ [dz] with z)``,
    which needs ``out`` (before the gate) when z is given. Our single ``saved`` tensor therefore carries both: out
    before the gate (when z is given) followed by x's bytes, flat, in the input dtype (``pack_saved``).

    mamba_ssm has no reverse mode: ``reverse`` flips the time-indexed inputs, scans, and flips the results back
    (copies that our kernels avoid). Its kernel takes fp32, fp16 and bf16 inputs on CUDA tensors; anything else is
    refused by mamba_ssm itself.
    """

    name = "mamba"

    def __init__(self, module):
        self.module = module

    @staticmethod
    def _y_slots(batch, dim, seqlen, has_z, input_size, state_size):
        """Input-dtype elements before x in ``saved``: the pre-gate output, padded so that x starts on a whole
        element of its own (wider) dtype."""
        ratio = max(1, state_size // input_size)
        return -(-(batch * dim * seqlen if has_z else 0) // ratio) * ratio

    @classmethod
    def saved_numel(cls, batch, dim, seqlen, d_state, has_z, input_size, state_size):
        """Length of the flat ``saved`` tensor (in input-dtype elements)."""
        n_chunks = -(-seqlen // MAMBA_CHUNK)
        return (cls._y_slots(batch, dim, seqlen, has_z, input_size, state_size)
                + batch * dim * n_chunks * 2 * d_state * state_size // input_size)

    @classmethod
    def pack_saved(cls, y, x, dtype):
        x_part = x.contiguous().reshape(-1).view(dtype)
        if y is None:
            return x_part.clone()
        pad = cls._y_slots(*y.shape, True, y.element_size(), x.element_size()) - y.numel()
        return torch.cat([y.reshape(-1), y.new_zeros(pad), x_part])

    @classmethod
    def unpack_saved(cls, saved, u, A, has_z):
        batch, dim, seqlen = u.shape
        n_y = cls._y_slots(batch, dim, seqlen, has_z, u.element_size(), A.element_size())
        x = saved[n_y:].view(A.dtype).view(batch, dim, -(-seqlen // MAMBA_CHUNK), 2 * A.shape[1])
        return (saved[:batch * dim * seqlen].view(batch, dim, seqlen) if has_z else None), x

    @staticmethod
    def _flip(*ts):
        return [None if t is None else t.flip(-1) for t in ts]

    def fwd(self, u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse=False, return_last_state=False):
        if reverse:
            u, delta, B, C, z = self._flip(u, delta, B, C, z)
        u, delta, B, C = (t.contiguous() for t in (u, delta, B, C))
        z = None if z is None else z.contiguous()
        res = self.module.fwd(u, delta, A, B.unsqueeze(1), C.unsqueeze(1), D, z, delta_bias, bool(delta_softplus))
        y, x = res[0], res[1]
        out = res[2] if z is not None else y
        last = x[:, :, -1, 1::2].contiguous() if return_last_state else None
        saved = self.pack_saved(y if z is not None else None, x, u.dtype)
        return (out.flip(-1) if reverse else out), saved, last

    def bwd(self, u, delta, A, B, C, D, z, delta_bias, dout, saved, delta_softplus, reverse=False):
        if reverse:
            u, delta, B, C, z, dout = self._flip(u, delta, B, C, z, dout)
        u, delta, B, C, dout = (t.contiguous() for t in (u, delta, B, C, dout))
        z = None if z is None else z.contiguous()
        y, x = self.unpack_saved(saved, u, A, z is not None)
        res = self.module.bwd(u, delta, A, B.unsqueeze(1), C.unsqueeze(1), D, z, delta_bias, dout, x, y, None,
                              bool(delta_softplus), False)
        du, ddelta, dA, dB, dC, dD, ddelta_bias = res[:7]
        dz = res[7] if z is not None else None
        dB, dC = dB.squeeze(1), dC.squeeze(1)
        if reverse:
            du, ddelta, dB, dC, dz = self._flip(du, ddelta, dB, dC, dz)
        return [du, ddelta, dA, dB, dC, dD if D is not None else None, dz,
                ddelta_bias if delta_bias is not None else None]


def _mamba_version():
    try:
        return importlib.metadata.version("mamba_ssm")
    except Exception:  # not installed as a distribution (a source tree on the path)
        return "version unknown"


@dataclass
class _Loaded:
    backend: Optional[object] = None
    how: str = ""  # "prebuilt", "jit"
    reason: str = ""  # why it is unavailable


@dataclass
class _Registry:
    loaded: dict = field(default_factory=dict)
    announced: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_registry = _Registry()


def _source_root():
    """The folder holding csrc/: the repository checkout, or the copy shipped inside the package."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../vim_ds
    for root in (os.path.dirname(here), here):
        if os.path.isdir(os.path.join(root, "csrc")):
            return root
    return None


def _jit_build(kind):
    # here, not at the top: torch.utils.cpp_extension imports setuptools (start-up) and warns where CUDA is missing
    from torch.utils import cpp_extension

    root = _source_root()
    if root is None:
        raise RuntimeError("the kernel sources (csrc/) are not installed")
    extension = build_config.cpu_extension_args(root) if kind == "cpu" else build_config.gpu_extension_args(root)
    build_dir = os.path.join(
        os.environ.get("VIM_DS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vim_ds"),
        f"{kind}-torch{torch.__version__}",
    )
    os.makedirs(build_dir, exist_ok=True)
    log.warning("vim_ds: vim_ds._scan_%s is not installed; JIT-building it into %s (compiled once, then reused)", kind,
                build_dir)
    return cpp_extension.load(name=f"vim_ds_scan_{kind}", build_directory=build_dir,
                              verbose=os.environ.get("VIM_DS_JIT_VERBOSE", "0") == "1",
                              **build_config.jit_flags(extension))


def _gpu_unavailable_reason():
    if not (torch.version.cuda or torch.version.hip):
        return "this torch build has no CUDA or ROCm support"
    return None


def _load(kind) -> _Loaded:
    """Load the compiled kernel of `kind` ('cpu', 'cuda' or 'mamba'), JIT-building ours if needed; never raises."""
    if kind == "mamba":
        try:
            return _Loaded(MambaBackend(importlib.import_module(MAMBA_MODULE)), f"mamba_ssm {_mamba_version()}")
        except ImportError as exc:
            return _Loaded(reason=f"mamba_ssm is not installed ({MAMBA_MODULE} does not import: {exc}); it is "
                                  f"optional: pip install mamba-ssm on a CUDA machine")
    if kind == "cuda":
        reason = _gpu_unavailable_reason()
        if reason:
            return _Loaded(reason=reason)
    try:
        module = importlib.import_module(f"vim_ds._scan_{kind}")
        return _Loaded(ExtensionBackend(kind, module), "prebuilt")
    except ImportError as exc:
        prebuilt_error = f"vim_ds._scan_{kind} not importable ({exc})"
    if os.environ.get(ENV_JIT, "1") == "0":
        return _Loaded(reason=f"{prebuilt_error}; JIT build disabled by {ENV_JIT}=0")
    if kind == "cuda" and not torch.cuda.is_available():
        return _Loaded(reason=f"{prebuilt_error}; no GPU here to JIT-build it for")
    try:
        return _Loaded(ExtensionBackend(kind, _jit_build(kind)), "jit")
    except Exception as exc:  # a failed compiler run has many exception types
        log.debug("JIT build of the %s kernel failed", kind, exc_info=True)
        text = str(exc).strip()
        first_line = text.split(":", 1)[0] if text.startswith("Error building extension") else text[:200]
        return _Loaded(reason=f"{prebuilt_error}; JIT build failed: {first_line or type(exc).__name__} "
                              f"(run with VIM_DS_JIT_VERBOSE=1 to see the compiler output)")


def _apply_cpu_isa(loaded: _Loaded) -> None:
    """VIM_DS_CPU_ISA, if set, picks the CPU kernel's instruction-set variant (a narrower one than the widest the CPU
    runs, to compare or to rule one out); a name this CPU cannot run is a one-line error."""
    name = os.environ.get(ENV_CPU_ISA, "").strip().lower()
    if name and loaded.backend is not None:
        try:
            loaded.backend.module.set_isa(name)
        except RuntimeError as exc:
            raise ValueError(f"{ENV_CPU_ISA}={name}: {str(exc).splitlines()[0]}") from None


def check_cpu_isa(text: str) -> None:
    """A one-line ValueError naming VIM_DS_CPU_ISA when the CPU kernel (loaded now if it is not yet, which applies
    the variable) has no variant `text`; the kernel's variant in use is left as it was."""
    loaded = load("cpu")
    if loaded.backend is None:
        return  # no CPU kernel here: nothing to choose from (`vim-ds env` says why)
    module = loaded.backend.module
    try:
        module.set_isa(module.set_isa(text.strip().lower()))
    except RuntimeError as exc:
        raise ValueError(f"{ENV_CPU_ISA}={text.strip().lower()}: {str(exc).splitlines()[0]}") from None


def load(kind) -> _Loaded:
    with _registry.lock:
        if kind not in _registry.loaded:
            loaded = _load(kind)
            if kind == "cpu":
                _apply_cpu_isa(loaded)
            _registry.loaded[kind] = loaded
        return _registry.loaded[kind]


def _announce(key, message):
    if key not in _registry.announced:
        _registry.announced.add(key)
        log.warning(message)


def forced_backend() -> Optional[str]:
    return read_forced_backend(os.environ.get(ENV_BACKEND, ""))


def read_forced_backend(text: str) -> Optional[str]:
    """The backend a VIM_DS_SCAN value names (None for none), or a one-line ValueError saying what it accepts."""
    name = text.strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={name!r} is not a scan backend; choose one of {', '.join(BACKENDS)}")
    return name


def get_backend(device: torch.device):
    """The backend for tensors on `device`: VIM_DS_SCAN if set, else the compiled kernel, else ref."""
    kind = "cpu" if device.type == "cpu" else "cuda"
    name = forced_backend()
    if name == "ref":
        return RefBackend()
    if name == "mamba":
        if device.type == "cpu":
            raise ValueError(f"{ENV_BACKEND}=mamba cannot run on cpu tensors (mamba_ssm's kernel is CUDA-only); "
                             f"use {ENV_BACKEND}=cpu or ref")
        loaded = load("mamba")
        if loaded.backend is None:
            raise RuntimeError(f"{ENV_BACKEND}=mamba but {loaded.reason}")
        return loaded.backend
    if name is not None and name != kind:
        raise ValueError(f"{ENV_BACKEND}={name} cannot run on {device.type} tensors; "
                         f"use {ENV_BACKEND}={kind} or ref, or move the tensors")
    loaded = load(kind)
    if loaded.backend is not None:
        return loaded.backend
    if name is not None:
        raise RuntimeError(f"{ENV_BACKEND}={name} but the {kind} kernel is unavailable: {loaded.reason}")
    _announce(kind, f"vim_ds: the {kind} selective-scan kernel is unavailable ({loaded.reason}); "
                    f"using the pure-PyTorch reference, which is much slower")
    return RefBackend()


def report() -> dict:
    """What `vim-ds env` prints: every backend, whether it is available and how it was obtained."""
    rows = {"ref": {"available": True, "how": "pure PyTorch", "reason": ""}}
    for kind in ("cpu", "cuda", "mamba"):
        try:
            loaded = load(kind)
        except ValueError as exc:  # a forced variant this machine cannot run
            rows[kind] = {"available": False, "how": "", "reason": str(exc)}
            continue
        rows[kind] = {"available": loaded.backend is not None, "how": loaded.how, "reason": loaded.reason}
        # which instruction-set variant, of those the CPU runs
        if kind == "cpu" and loaded.backend is not None:
            module = loaded.backend.module
            rows[kind]["how"] += f", {module.isa()} (of {', '.join(module.available_isas())})"
    return rows
