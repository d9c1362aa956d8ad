"""Regional compilation (`--compile`): each transformer block under `torch.compile`, one compiled block for all layers.

As torchtitan and FastVideo do, the unit compiled is a block, not the model: every layer of a family runs the same
block code, and with torch's inlining of built-in modules (`torch._dynamo.config.inline_inbuilt_nn_modules`, on by
default) a block's parameters are graph inputs, so the graph compiled for layer 0 serves every layer. The embeddings
and the final layer stay eager unless the family names them as regions of their own (`FamilyModel.region`: the DiT's
embedding and final layer); the methods' maths around the model stays eager. Inside a compiled region the TP = 1
linears run without megatron-core's autograd Functions (`linears.AdaptableLinear._whole`, eager too) and the
fused kernels are custom ops (`dmd2_kernels`), so nothing breaks the graph.

Choice (`choose`): `--compile` / `--no-compile`; neither: on with CUDA, off on a CPU (where inductor's C++ compile of
each graph costs seconds and eager CPU kernels gain little). A layout the compiled linears do not trace (TP, CP or
sequence parallelism > 1: megatron-core's collectives; --transformer-impl transformer_engine) keeps eager blocks: by
default with the reason on the start-up line, asked for with `--compile` a ConfigError; so does TORCH_COMPILE_DISABLE=1
in the environment (torch.compile a no-op there; the tests set it).

Graphs: one per (block class, grad mode, input shapes) seen, a dynamic one after a second size of a dim (torch's
automatic dynamic shapes); past torch's `recompile_limit` (8) graphs of one block a new signature runs eager, and a
line says so. A stateful KV-cache pass (a causal student streaming chunk by chunk) runs its blocks eager: its
write flag and positions change per chunk and layer (`Wan._block`). `GRAPHS` counts every graph compiled in this
process; `seal()`, called by the trainers after their first (warm-up) cycle, makes each later compilation print one
line naming the block and the count: a recompile inside a run is a shape or mode the warm-up did not see, and costs
seconds each time.
"""
from __future__ import annotations

import collections
import os
import sys
from typing import Callable, Iterable, Optional

import torch

import dmd2_kernels
from dmd2_mega.errors import ConfigError

GRAPHS: collections.Counter = collections.Counter()
"""Graphs compiled in this process, per block class name."""
_SEALED = {"on": False}
_BACKENDS: dict = {}
_FUNCTIONS: dict = {}


def choose(asked: Optional[bool], device: torch.device, tp: int = 1, cp: int = 1, sp: bool = False,
           impl: str = "local") -> tuple[bool, str]:
    """(compile the blocks?, the reason for the start-up line) for `--compile` / `--no-compile` (`asked`, None: not
    given) on this run's device and layout (module docstring)."""
    blockers = [what for what, bad in (("TP > 1", tp > 1), ("CP > 1", cp > 1), ("--sequence-parallel", sp),
                                       ("--transformer-impl transformer_engine", impl != "local")) if bad]
    if asked is False:
        return False, "off (--no-compile)"
    if _disabled():  # TORCH_COMPILE_DISABLE=1 (the tests' environment): torch.compile is a no-op
        if asked:
            raise ConfigError("--compile: TORCH_COMPILE_DISABLE=1 is set in the environment, which turns "
                              "torch.compile off; unset it or drop --compile")
        return False, "off (TORCH_COMPILE_DISABLE=1 in the environment)"
    if blockers:
        why = (f"{', '.join(blockers)}: the compiled blocks trace megatron-core's TP = 1 local linears only (its "
               f"collectives break the graph)")
        if asked:
            raise ConfigError(f"--compile: {why}; drop --compile (eager blocks)")
        return False, f"off ({why})"
    if asked:
        return True, "on (--compile)"
    if device.type == "cuda":
        return True, "on (the default on CUDA; --no-compile for eager blocks)"
    return False, "off (the default on a CPU: inductor's compile costs more than it saves there; --compile to force)"


def _disabled() -> bool:
    """torch.compile turned off for the process: dynamo's own switch once it is imported, else the variable it reads
    at import (importing dynamo here would cost every process its start-up: tests/test_megatron_import.py)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return bool(dynamo.config.disable)
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


def _backend(name: str):
    """One backend object per block class: torch guards a cached graph on the backend that compiled it."""
    if name not in _BACKENDS:
        _BACKENDS[name] = _counting_backend(name)
    return _BACKENDS[name]


def _counting_backend(name: str):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        GRAPHS[name] += 1
        limit = torch._dynamo.config.recompile_limit
        if GRAPHS[name] == limit:
            print(f"> compile: {name} has {limit} graphs, torch's limit (torch._dynamo.config.recompile_limit): a "
                  f"later new shape or mode of it runs eager", file=sys.stderr, flush=True)
        if _SEALED["on"]:
            print(f"> compile: a new graph of {name} after the first cycle ({sum(GRAPHS.values())} graphs in all): "
                  f"a shape or grad mode not run before (an evaluation, a new rollout batch); each costs a "
                  f"compilation", file=sys.stderr, flush=True)
        return compile_fx(gm, example_inputs)
    return compile_graph


def compile_blocks(blocks: Iterable[torch.nn.Module]) -> int:
    """Compile each block in place (`nn.Module.compile`); returns how many. Blocks of one class share their graphs."""
    dmd2_kernels.register_ops()  # the fused ops as torch.ops.dmd2.* before any trace (they register lazily otherwise)
    n = 0
    for blk in blocks:
        blk.compile(backend=_backend(type(blk).__name__))
        n += 1
    return n


def function(fn: Callable, name: str) -> Callable:
    """`fn` (a family's method, taking the model first) under torch.compile, one compiled function per `fn` for the
    process: every model of the class shares its graphs (`FamilyModel.region`)."""
    if fn not in _FUNCTIONS:
        dmd2_kernels.register_ops()
        _FUNCTIONS[fn] = torch.compile(fn, backend=_backend(name))
    return _FUNCTIONS[fn]


def graphs() -> int:
    """Graphs compiled so far in this process."""
    return sum(GRAPHS.values())


def seal() -> None:
    """After the warm-up: every later compilation prints a line (module docstring)."""
    _SEALED["on"] = True


def reset() -> None:
    """Forget the counts and the seal (tests)."""
    GRAPHS.clear()
    _SEALED["on"] = False
