"""What importing megatron-core does to a process, set before it is imported: its jit fuser off (half of every
process's start-up) and its warnings about optional GPU extras filtered.

megatron-core 0.16 decorates its own fused bias-GeLU / GeGLU / SwiGLU / bias-dropout-add functions with
`megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2. Applying `torch.compile` at import time
imports torch._dynamo and torch._inductor: `import megatron.core` takes 10 s instead of 6 s on a 2-core x86 CPU
(`python -X importtime`), and every rank of every launch pays it. dmd2-mega calls none of those functions: its
fusions are the Triton kernels in `kernels/`, and of megatron-core it uses the parallel linears, `TransformerConfig`,
`parallel_state` and the RNG tracker. So when megatron-core's `jit` module is first loaded, its own switch
`disable_jit_fuser()` runs right after it (the decorator becomes megatron-core's `noop_decorator`, so the functions
stay callable, eagerly), before any module applies the decorator.

Nothing happens when megatron.core was imported before dmd2_mega, and `DMD2_MEGA_MEGATRON_JIT=1` keeps megatron-core's
torch.compile fuser. `fuser_state()` says which of the three holds (the start-up line names it).

megatron-core warns at import, from four modules (its optimizer, grad clipping, FSDP mixed precision), that
"Transformer Engine and Apex are not installed. Falling back to ...": on every CPU run, for code paths dmd2-mega
does not take (it uses its own optimizer and kernels). `install()` filters exactly those UserWarnings (that text,
raised from a megatron module), once. A flag that asks for an extra which is missing (`--transformer-impl
transformer_engine`, `--optimizer-impl apex`) is a one-line ConfigError of ours naming the package and the flag
(`models/linears.py`, `optim.py`).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import warnings

MODULE = "megatron.core.jit"
ENV = "DMD2_MEGA_MEGATRON_JIT"
EXTRAS_WARNING = r"Transformer Engine and Apex are not installed\. "


class _DisableAfterLoad(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` through the other finders and wraps its loader so that `disable_jit_fuser()` runs
    as soon as the module's own code has."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)  # once: the real finders below us locate the file
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_disable(module):
            exec_module(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_then_disable
        return spec


def install() -> None:
    """Called by `dmd2_mega/__init__.py`, before any module of the package imports megatron-core."""
    warnings.filterwarnings("ignore", message=EXTRAS_WARNING, category=UserWarning, module=r"megatron")
    if MODULE in sys.modules or os.environ.get(ENV) == "1":
        return
    if not any(isinstance(f, _DisableAfterLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _DisableAfterLoad())


def fuser_state() -> str:
    """'off' (the no-op decorator), 'torch.compile' (megatron-core's default: DMD2_MEGA_MEGATRON_JIT=1, or
    megatron.core imported before dmd2_mega), or 'not loaded'."""
    jit = sys.modules.get(MODULE)
    if jit is None:
        return "not loaded"
    return "off" if jit.jit_fuser is jit.noop_decorator else "torch.compile"
