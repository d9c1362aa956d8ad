"""Attention core of every family: softmax(q k^T / sqrt(d)) v, no mask.

    attention(q, k, v, backend): q [B, Sq, H, d], k / v [B, Skv, H, d] -> [B, Sq, H, d]

Tokens first, heads second: the layout the projections give and flash-attn takes, so no backend copies its
inputs (SDPA gets [B, H, S, d] views). Every call site goes through here: DiT and Wan self-attention, Wan's
cross-attention (the text, an I2V Wan's image tokens), a causal Wan's chunk-by-chunk blocks and its KV-cached
stream (`models/wan/causal.py`). Causal students never pass a mask: each chunk attends to contiguous key ranges.

--attention-backend (`choose` names the pick on the trainers' start-up line):
    sdpa    torch's scaled_dot_product_attention. On CUDA the kernel is set with `sdpa_kernel`, probed once per
            (device, dtype, head dim): cuDNN attention and flash for fp16 / bf16 (cuDNN first from Hopper, sm90, where
            it is the faster; flash first before; the second runs a shape the first refuses), else the
            memory-efficient kernel (fp32: neither fast kernel takes it), else math. On a CPU torch's own choice:
            its flash-attention CPU kernel (math where that does not apply).
    cudnn   SDPA's cuDNN attention alone (CUDA, fp16 / bf16): a shape it refuses is an error, not another kernel.
    flash3  FlashAttention-3, `flash_attn_interface.flash_attn_func` (Hopper, fp16 / bf16).
    flash   flash-attn 2's `flash_attn_func` (CUDA sm80+, fp16 / bf16).
A backend asked for that is not installed or cannot run here (no CUDA, another dtype, GPU or head dim) is one
ConfigError naming the flag and the reason, never a silent fallback.
"""
from __future__ import annotations

import importlib.util
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dmd2_mega.errors import ConfigError

BACKENDS = ("sdpa", "cudnn", "flash3", "flash")
"""--attention-backend's choices (module docstring)."""
_MODULES = {"flash": ("flash_attn", "the flash-attn package (pip install flash-attn)"),
            "flash3": ("flash_attn_interface", "FlashAttention-3 (flash_attn_interface, built from "
                                               "flash-attention's hopper/ folder)")}
_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256  # flash-attn 2 and 3, and torch's flash kernel
_NAMES = {SDPBackend.CUDNN_ATTENTION: "cuDNN attention", SDPBackend.FLASH_ATTENTION: "flash attention",
          SDPBackend.EFFICIENT_ATTENTION: "memory-efficient attention", SDPBackend.MATH: "math"}
_PICKED: dict = {}
"""(CUDA device index, dtype name, head dim) -> (SDPA kernels in priority order, words): `sdpa`'s probes."""


def check_backend(backend: str) -> None:
    """At build: the package `backend` needs is installed and CUDA is there (dtype, GPU and head dim: `choose`)."""
    if backend in _MODULES and not _installed(_MODULES[backend][0]):
        raise ConfigError(f"--attention-backend {backend} needs {_MODULES[backend][1]}, which is not installed "
                          f"(install it, or use --attention-backend sdpa)")
    if backend != "sdpa" and not torch.cuda.is_available():
        raise ConfigError(f"--attention-backend {backend} needs CUDA, which this machine lacks; use "
                          f"--attention-backend sdpa on a CPU")


def choose(backend: str, device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """(backend, the start-up line's words) for --attention-backend `backend` on this run's device, compute dtype and
    head dim: the kernel `attention` will run, named; ConfigError where the backend asked for cannot run there."""
    check_backend(backend)
    device = torch.device(device)
    where = f"{_short(dtype)}, head dim {head_dim}"
    if device.type != "cuda":
        if backend != "sdpa":
            raise ConfigError(f"--attention-backend {backend} runs on CUDA; this run's device is {device.type} "
                              f"(use --attention-backend sdpa)")
        kernel = _probe(None, device, dtype, head_dim)[0]
        name = "its flash-attention CPU kernel" if kernel == SDPBackend.FLASH_ATTENTION else _NAMES.get(kernel)
        return backend, f"sdpa ({name}, torch's choice on a {device.type}; {where})"
    if dtype not in _HALF and backend != "sdpa":
        raise ConfigError(f"--attention-backend {backend} takes fp16 / bf16; this run computes in {_short(dtype)} "
                          f"(give --bf16, or use --attention-backend sdpa)")
    cap = torch.cuda.get_device_capability(device)
    where = f"sm{cap[0]}{cap[1]}, {where}"
    if backend == "sdpa":
        return backend, f"sdpa ({_pick(_index(device), dtype, head_dim)[1]})"
    if backend == "cudnn":
        kernel, why = _probe((SDPBackend.CUDNN_ATTENTION,), device, dtype, head_dim)
        if kernel is None:
            raise ConfigError(f"--attention-backend cudnn: torch's cuDNN attention cannot run {where}"
                              f"{': ' + why if why else ''}; use --attention-backend sdpa")
        return backend, f"cudnn (cuDNN attention alone; {where})"
    name, arch = ("FlashAttention-3", "Hopper (sm90)") if backend == "flash3" else ("flash-attn 2", "sm80 and newer")
    if (cap[0] != 9) if backend == "flash3" else cap < (8, 0):
        raise ConfigError(f"--attention-backend {backend}: {name} runs on {arch}; this GPU is sm{cap[0]}{cap[1]} "
                          f"(use --attention-backend sdpa)")
    if head_dim > _MAX_HEAD_DIM:
        raise ConfigError(f"--attention-backend {backend}: {name} takes head dims up to {_MAX_HEAD_DIM}; this model's "
                          f"is {head_dim} (use --attention-backend sdpa)")
    return backend, f"{backend} ({name}'s flash_attn_func; {where})"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v of q [B, Sq, H, d] over k, v [B, Skv, H, d] -> [B, Sq, H, d] (module docstring)."""
    if backend in _MODULES:
        if q.dtype not in _HALF:  # a host check of metadata; a model never built through `choose` meets it here
            raise ConfigError(f"--attention-backend {backend} takes fp16 / bf16 tensors, got {_short(q.dtype)} "
                              f"(give --bf16, or use --attention-backend sdpa)")
        return flash(q, k, v, backend)
    if backend == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v)
    if q.device.type == "cuda":
        kernels = _cuda_kernels(q.device.index, q.dtype, q.shape[-1])
        if kernels is not None:
            with sdpa_kernel(list(kernels), set_priority=True):
                return sdpa(q, k, v)
    return sdpa(q, k, v)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's SDPA on [B, H, S, d] views of the [B, S, H, d] tensors (no copy), the output viewed back."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """flash-attn 2 (`flash`) or FlashAttention-3 (`flash3`) on the [B, S, H, d] tensors as they are: both take any
    strides but a unit last one, which every caller's q / k / v have."""
    if backend == "flash3":
        from flash_attn_interface import flash_attn_func
    else:
        from flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out  # FlashAttention-3 builds before mid-2025 also return the lse


def _cuda_kernels(index: int, dtype: torch.dtype, head_dim: int):
    """sdpa's kernels on CUDA device `index` for `dtype` and `head_dim` (`_pick`, probed once), or None. Under
    torch.compile a probed choice is a constant of the graph (a read of `_PICKED`, which dynamo guards); one not
    probed before tracing (no start-up `choose`, no eager call first) is None, SDPA's own choice, since a probe
    runs kernels that a trace cannot hold. (`torch.compiler.assume_constant_result` would do it too, but decorating
    at import imports torch._dynamo into every process: tests/test_megatron_import.py.)"""
    key = (index, str(dtype), head_dim)
    if key in _PICKED:
        return _PICKED[key][0]
    if torch.compiler.is_compiling():
        return None
    return _pick(index, dtype, head_dim)[0]


def _pick(index: int, dtype: torch.dtype, head_dim: int) -> tuple[tuple, str]:
    """(SDPA kernels in priority order, words) of `sdpa` on CUDA device `index` (module docstring): the first set SDPA
    can run a probe of this dtype and head dim with, probed once per process."""
    key = (index, str(dtype), head_dim)
    if key not in _PICKED:
        device = torch.device("cuda", index)
        cap = torch.cuda.get_device_capability(device)
        where = f"sm{cap[0]}{cap[1]}, {_short(dtype)}, head dim {head_dim}"
        cudnn, fa = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION
        fast = (cudnn, fa) if cap >= (9, 0) else (fa, cudnn)
        first = _probe(fast, device, dtype, head_dim)[0]
        if first is not None:
            fast = (first, fast[1] if first == fast[0] else fast[0])
            _PICKED[key] = fast, f"{_NAMES[fast[0]]}, {_NAMES[fast[1]]} where it refuses a shape; {where}"
        else:
            why = ("cuDNN and flash attention take fp16 / bf16 (--bf16)" if dtype not in _HALF else
                   "torch's cuDNN and flash kernels refuse it")
            for kernel in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
                if _probe((kernel,), device, dtype, head_dim)[0] is not None:
                    _PICKED[key] = (kernel,), f"{_NAMES[kernel]}: {why}; {where}"
                    break
            else:
                raise ConfigError(f"--attention-backend sdpa: torch has no attention kernel for {where}")
    return _PICKED[key]


def _probe(kernels, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple:
    """(the kernel SDPA picks for q = k = v [1, 2, 128, head_dim] of `dtype` on `device` with only `kernels` allowed,
    in that order (None: torch's defaults), or None; torch's reasons when it picks none)."""
    q = torch.zeros(1, 2, 128, head_dim, dtype=dtype, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if kernels is None:
                choice = torch._fused_sdp_choice(q, q, q)
            else:
                with sdpa_kernel(list(kernels), set_priority=True):
                    choice = torch._fused_sdp_choice(q, q, q)
        except RuntimeError:
            choice = SDPBackend.ERROR.value
    if choice == SDPBackend.ERROR.value:
        return None, " ".join(" ".join(str(w.message).split()) for w in caught)[:400]
    return SDPBackend(choice), ""


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _installed(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch."))
