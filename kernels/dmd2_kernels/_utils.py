"""Shared helpers of the kernel package: path dispatch, argument checks, per-sample scalars, launch sizes, and the
registration of the Triton paths as custom ops.

Dispatch (every public op takes ``impl=None | "triton" | "torch"``):
  1. an explicit ``impl`` argument wins;
  2. else ``DEFAULT_IMPL`` (the environment variable ``DMD2_KERNELS=triton|torch|auto``, read ONCE, when this
     module is imported; ``set_default_impl`` changes it, e.g. in tests) forces one path;
  3. else (``DMD2_KERNELS`` unset or ``auto``) CUDA tensors take the Triton path where it pays and CPU tensors the
     torch path (a dtype Triton is not asked to handle here, e.g. float64, also takes the torch path). "Where it
     pays": an op passes its name (``op=``), and below ``FUSED_FROM[(op, direction)]`` elements (of its first
     tensor) the torch path runs; "fwd+bwd" when a gradient will flow through the op, else "fwd".
A forced Triton path on CPU tensors needs ``TRITON_INTERPRET=1`` in the environment BEFORE triton is
first imported (triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted);
that is how the tests run the kernels without a GPU.

Checks: each public op checks its arguments once (shapes, dtypes, devices; a few attribute reads) and then calls
its path; the paths, custom ops and launchers below it never check again. Under torch.compile the checks and the
dispatch run at trace time only (they read static tensor properties, so they cause no graph break).

Custom ops (``kernel_op``): each op's Triton path is registered as ``torch.ops.dmd2.<name>`` with
``torch.library.triton_op`` (launches through ``wrap_triton``) and its backward through ``register_autograd``, so
that torch.compile traces through it (inductor sees the kernels) and CUDA graphs capture it. The interpreter
(TRITON_INTERPRET=1) cannot run on the fake tensors a trace uses, so there the op is an opaque
``torch.library.custom_op`` whose fake implementation is the same function with its launches skipped. The torch
path stays plain torch ops (traced, fused by inductor, visible to a dispatch mode).

Per-sample scalars (sigma, guidance): a Python number stays a Python float (the kernels take it as a scalar
argument, the torch path as a Python scalar: no tensor is made, nothing is launched); a tensor becomes a [B]
float32 view: a one-element tensor is expanded (stride 0) and a tensor of B elements in any [B, 1, ..., 1] layout
is viewed as [B], without a copy when it already is float32 on the device (the kernels take its stride).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor

# Read once, at the moment this package's kernels are decorated (the same moment triton reads it).
INTERPRET = bool(triton.knobs.runtime.interpret)
IMPLS = ("triton", "torch")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Elementwise / reduction tile: 4096 elements per program (16 per thread at 8 warps), so that the
# large-size launches stay bandwidth-bound on a GPU and the interpreter runs few program instances.
MAX_BLOCK = 4096


# The size, in elements of an op's first tensor, from which its fused kernel beat eager torch on an H200 (bf16;
# benchmarks/RESULTS.md "First GPU run", 9534d46): x0 and the flow-matching loss lost at the cycle's 0.5-2.1M
# elements (0.63-0.90x) and won from 2^26; CFG, the DMD loss, adaLN and qk-norm + RoPE won at every size measured
# (absent here: 0). Per (op, direction). DMD2_KERNEL_FUSED_FROM="x0=1048576,flow_matching:fwd+bwd=0" overrides
# entries (read once, at import).
FUSED_FROM = {("x0", "fwd"): 2**26, ("x0", "fwd+bwd"): 2**26,
              ("flow_matching", "fwd"): 2**26, ("flow_matching", "fwd+bwd"): 2**26}
DIRECTIONS = ("fwd", "fwd+bwd")


def parse_fused_from(text: str) -> dict:
    """"op[:direction]=N,..." -> {(op, direction): N} (an op without a direction: both)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        op, _, direction = key.strip().partition(":")
        if not sep or not value.strip().isdigit() or direction not in ("", *DIRECTIONS):
            raise ValueError(f"DMD2_KERNEL_FUSED_FROM: {item!r}: expected op[:fwd|fwd+bwd]=ELEMENTS")
        for d in ((direction,) if direction else DIRECTIONS):
            out[(op.strip(), d)] = int(value)
    return out


FUSED_FROM.update(parse_fused_from(os.environ.get("DMD2_KERNEL_FUSED_FROM", "")))


class KernelError(ValueError):
    """Bad argument or impossible dispatch for an op of the ``kernels`` package."""


def parse_default_impl(text: str | None) -> str | None:
    """The value of ``DMD2_KERNELS`` -> "triton", "torch", or None (unset, empty or "auto": dispatch by device)."""
    value = (text or "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in IMPLS:
        raise KernelError(f"DMD2_KERNELS={value!r}: expected one of 'triton', 'torch' or 'auto'")
    return value


# The path every op takes when its ``impl`` argument is None (see the module docstring); None: by device and size.
DEFAULT_IMPL = parse_default_impl(os.environ.get("DMD2_KERNELS"))


def set_default_impl(impl: str | None) -> str | None:
    """Set ``DEFAULT_IMPL`` ("triton", "torch", "auto" or None) and return the previous value (tests: restore it, or
    ``monkeypatch.setattr(_utils, "DEFAULT_IMPL", ...)``). A compiled region that read the old value recompiles."""
    global DEFAULT_IMPL
    previous, DEFAULT_IMPL = DEFAULT_IMPL, parse_default_impl(impl)
    return previous


def fused_pays(op: str | None, *tensors: torch.Tensor) -> bool:
    """Whether op's fused kernel beats eager torch at these tensors' size (``FUSED_FROM``)."""
    if op is None:
        return True
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return tensors[0].numel() >= FUSED_FROM.get((op, "fwd+bwd" if grad else "fwd"), 0)


def resolve_impl(impl: str | None, *tensors: torch.Tensor, op: str | None = None) -> str:
    """Return "triton" or "torch" for op ``op`` on ``tensors`` (see the module docstring). Pass one tensor of each
    dtype involved; the device is ``tensors[0]``'s (the ops check that their tensors share it)."""
    forced = DEFAULT_IMPL if impl is None else impl
    ref = tensors[0]
    if forced is None:
        if ref.is_cuda and all(t.dtype in TRITON_DTYPES for t in tensors) and fused_pays(op, *tensors):
            return "triton"
        return "torch"
    if forced == "triton":
        for t in tensors:
            if t.dtype not in TRITON_DTYPES:
                raise KernelError(f"the Triton path takes float32/float16/bfloat16 tensors, got {t.dtype};"
                                  " use impl='torch' (or DMD2_KERNELS=torch)")
        if not ref.is_cuda and not INTERPRET:
            raise KernelError(f"the Triton path got {ref.device} tensors: it needs CUDA tensors, or "
                              "TRITON_INTERPRET=1 set before triton is imported (the CPU interpreter)")
    elif forced != "torch":
        raise KernelError(f"impl={forced!r}: expected None, 'triton' or 'torch'")
    return forced


def check_same(ref: torch.Tensor, name_ref: str, **others: torch.Tensor) -> None:
    """Raise unless every tensor in ``others`` has the shape, dtype and device of ``ref``."""
    for name, t in others.items():
        if not isinstance(t, torch.Tensor):
            raise KernelError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise KernelError(f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} "
                              f"(the shape of {name_ref})")
        if t.dtype != ref.dtype:
            raise KernelError(f"{name} has dtype {t.dtype}, expected {ref.dtype} (the dtype of {name_ref})")
        if t.device != ref.device:
            raise KernelError(f"{name} is on {t.device}, expected {ref.device} (the device of {name_ref})")
    if ref.dim() < 1 or ref.shape[0] < 1 or ref.numel() == 0:
        raise KernelError(f"{name_ref} must be a non-empty [B, ...] tensor, got shape {tuple(ref.shape)}")


def per_sample(value, batch: int, device: torch.device, name: str) -> float | torch.Tensor:
    """A Python number -> a Python float; a tensor -> a [B] float32 view on ``device`` (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and torch.is_grad_enabled():
            raise KernelError(f"{name} must not require grad: the ops treat per-sample scalars as constants")
        if value.numel() == 1:
            return value.reshape(()).to(device=device, dtype=torch.float32).expand(batch)
        if value.numel() != batch or value.shape[0] != batch:
            raise KernelError(f"{name} must be a number or a [B] tensor with B={batch}, got shape {tuple(value.shape)}")
        return value.reshape(batch).to(device=device, dtype=torch.float32)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise KernelError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")


def scalar_parts(s: float | torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """A ``per_sample`` scalar as a custom op's two arguments: (the [B] tensor or None, the number or 0.0)."""
    return (s, 0.0) if isinstance(s, torch.Tensor) else (None, s)


def scalar_args(t: torch.Tensor | None, value: float, dummy: torch.Tensor) -> tuple:
    """A per-sample scalar's four kernel arguments (pointer, stride, value, FROM_PTR: constexpr; kernels declare them
    in this order) for ``load_scalar``: a [B] tensor (any stride, 0 for an expanded number) or, without one, the float
    ``value`` (``dummy`` fills the pointer)."""
    return (t, t.stride(0), 0.0, True) if t is not None else (dummy, 0, value, False)


@triton.jit
def load_scalar(ptr, stride, value, b, FROM_PTR: tl.constexpr):
    """Per-sample scalar of sample b in float32: ptr[b * stride] if FROM_PTR, else the kernel argument ``value``."""
    if FROM_PTR:
        out = tl.load(ptr + b * stride).to(tl.float32)
    else:
        out = value  # a Python float argument is a float32 scalar in the kernel
    return out


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the torch path: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bcast(s: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A per-sample scalar for the torch path: [B] -> [B, 1, ..., 1] with the rank of ``like`` in the torch path's
    compute dtype; a Python float is returned as it is (a scalar operand launches nothing)."""
    if not isinstance(s, torch.Tensor):
        return s
    return s.to(compute_dtype(like.dtype)).view((-1,) + (1,) * (like.dim() - 1))


def flat(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> contiguous [B, N] view (a copy only for non-contiguous input)."""
    return x.contiguous().view(x.shape[0], -1)


def block_for(n: int) -> int:
    """Elementwise tile size for N elements per sample: a power of two in [128, MAX_BLOCK]."""
    return max(128, min(MAX_BLOCK, triton.next_power_of_2(n)))


def num_warps_for(block: int) -> int:
    return 8 if block >= 2048 else 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_budget(device: torch.device) -> int:
    """About how many programs fill the device: 4 per SM on CUDA, a handful in the interpreter."""
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8


def finfo_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


class _Interpreted:
    """``wrap_triton`` under the interpreter: launches on real tensors, and does nothing on fake ones (the fake
    implementation of an op, which a trace runs, only needs the shapes of its outputs)."""

    def __init__(self, kernel, grid=None):
        self.kernel, self.grid = kernel, grid

    def __getitem__(self, grid) -> "_Interpreted":
        return _Interpreted(self.kernel, grid)

    def __call__(self, *args, **kwargs) -> None:
        if not any(isinstance(a, FakeTensor) for a in args):
            self.kernel[self.grid](*args, **kwargs)


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` (every launch of a ``kernel_op`` goes through it), or under the
    interpreter its stand-in ``_Interpreted``: call it as ``wrap_triton(kernel)[grid](*args)``."""
    return _Interpreted(kernel) if INTERPRET else torch.library.wrap_triton(kernel)


class _KernelOp:
    """An op of ``kernel_op``, registered on its first call or by ``register_ops`` (registering a ``triton_op`` scans
    its function for kernels through torch's inductor, whose import costs every process seconds of its start-up:
    tests/test_megatron_import.py). ``register_autograd`` is kept until then."""

    def __init__(self, name: str, fn):
        self.name, self.fn, self.op, self.autograd = name, fn, None, None
        _OPS.append(self)

    def register_autograd(self, backward, setup_context=None) -> None:
        self.autograd = (backward, setup_context)

    def register(self):
        if self.op is None:
            if INTERPRET:
                op = torch.library.custom_op(f"dmd2::{self.name}", self.fn, mutates_args=())
                op.register_fake(self.fn)
            else:
                op = torch.library.triton_op(f"dmd2::{self.name}", self.fn, mutates_args=())
            if self.autograd is not None:
                op.register_autograd(self.autograd[0], setup_context=self.autograd[1])
            self.op = op
        return self.op

    def __call__(self, *args, **kwargs):
        return (self.op or self.register())(*args, **kwargs)


_OPS: list = []


def register_ops() -> None:
    """Register every op of the package as ``torch.ops.dmd2.*`` now: before a torch.compile trace (a registration
    inside one would be traced), e.g. by ``dmd2_mega.models.compiled``."""
    for op in _OPS:
        op.register()


def kernel_op(name: str):
    """Decorator: ``fn`` (typed arguments; returns fresh tensors that alias no input nor each other) as the
    functional custom op ``torch.ops.dmd2.<name>``: a ``triton_op`` on a GPU, an opaque ``custom_op`` with ``fn`` as
    its fake implementation under the interpreter (see the module docstring), registered on first use
    (``_KernelOp``; ``register_ops`` registers them all). Call the result like the op; ``.register_autograd`` it."""
    def register(fn):
        return _KernelOp(name, fn)
    return register
