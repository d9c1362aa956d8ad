"""Shared helpers of the kernel package: path dispatch, per-sample scalars, launch sizes.

Dispatch (every public op takes ``impl=None | "triton" | "torch"``):
  1. an explicit ``impl`` argument wins;
  2. else the environment variable ``DMD2_KERNELS=triton|torch`` forces one path;
  3. else (``DMD2_KERNELS`` unset or ``auto``) CUDA tensors take the Triton path where it pays and CPU tensors the
     torch path (a dtype Triton is not asked to handle here, e.g. float64, also takes the torch path). "Where it
     pays": an op passes its name (``op=``), and below ``FUSED_FROM[(op, direction)]`` elements (of its first
     tensor) the torch path runs; "fwd+bwd" when a gradient will flow through the op, else "fwd".
A forced Triton path on CPU tensors needs ``TRITON_INTERPRET=1`` in the environment BEFORE triton is
first imported (triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted);
that is how the tests run the kernels without a GPU.

Per-sample scalars (sigma, guidance) are [B] float32 tensors; a Python number or a one-element
tensor is broadcast to [B]; a tensor of B elements in any [B, 1, ..., 1] layout is flattened to [B].
"""
from __future__ import annotations

import functools
import os

import torch
import triton

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


def fused_pays(op: str | None, *tensors: torch.Tensor) -> bool:
    """Whether op's fused kernel beats eager torch at these tensors' size (``FUSED_FROM``)."""
    if op is None:
        return True
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return tensors[0].numel() >= FUSED_FROM.get((op, "fwd+bwd" if grad else "fwd"), 0)


class KernelError(ValueError):
    """Bad argument or impossible dispatch for an op of the ``kernels`` package."""


def resolve_impl(impl: str | None, *tensors: torch.Tensor, op: str | None = None) -> str:
    """Return "triton" or "torch" for op ``op`` on ``tensors`` (see the module docstring)."""
    forced = impl
    if forced is None:
        env = os.environ.get("DMD2_KERNELS", "").strip().lower()
        if env and env not in ("auto",):
            if env not in IMPLS:
                raise KernelError(f"DMD2_KERNELS={env!r}: expected one of 'triton', 'torch' or 'auto'")
            forced = env
    ref = tensors[0]
    if forced is None:
        if ref.is_cuda and all(t.dtype in TRITON_DTYPES for t in tensors) and fused_pays(op, *tensors):
            return "triton"
        return "torch"
    if forced not in IMPLS:
        raise KernelError(f"impl={forced!r}: expected None, 'triton' or 'torch'")
    if forced == "triton":
        for t in tensors:
            if t.dtype not in TRITON_DTYPES:
                raise KernelError(f"the Triton path takes float32/float16/bfloat16 tensors, got {t.dtype};"
                                  " use impl='torch' (or DMD2_KERNELS=torch)")
            if t.device != ref.device:
                raise KernelError(f"all tensors must be on one device, got {ref.device} and {t.device}")
        if not ref.is_cuda and not INTERPRET:
            raise KernelError(f"the Triton path got {ref.device} tensors: it needs CUDA tensors, or "
                              "TRITON_INTERPRET=1 set before triton is imported (the CPU interpreter)")
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


def per_sample(value, batch: int, device: torch.device, name: str) -> torch.Tensor:
    """A Python number or tensor -> contiguous [B] float32 on ``device`` (see module docstring)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and torch.is_grad_enabled():
            raise KernelError(f"{name} must not require grad: the ops treat per-sample scalars as constants")
        if value.numel() == 1:
            value = value.reshape(1).expand(batch)
        elif value.numel() != batch or value.shape[0] != batch:
            raise KernelError(f"{name} must be a number or a [B] tensor with B={batch}, got shape {tuple(value.shape)}")
        return value.detach().reshape(batch).to(device=device, dtype=torch.float32).contiguous()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((batch,), float(value), dtype=torch.float32, device=device)
    raise KernelError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the torch path: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bcast(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] with the rank of ``like``, in the torch path's compute dtype."""
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
