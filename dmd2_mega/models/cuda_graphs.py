"""CUDA graphs of a cycle's model calls (`--cuda-graphs`): each forward of a role replayed from a captured graph.

A DMD2 cycle on a small model is launch-bound: the GPU waits for Python to issue hundreds of kernels per forward
(issue 51). With `--cuda-graphs` every call `model(x, sigma, cond)` of a role inside a cycle (`capturing`) runs from
a CUDA graph captured once per signature (the argument shapes, dtypes and which need grad, and grad mode), as
Megatron-LM's per-layer graphs and torch's `make_graphed_callables` do, here per model call:
    with grad (the critic's and the actor's steps)  forward and backward graphs (`torch.cuda.make_graphed_callables`):
                                                     the parameters' gradients reach autograd, which adds them into
                                                     their bound fp32 `.grad` (train/grad_buffer.py) as in eager
    without grad (the rollout's steps, the teacher's scores, a no-grad critic forward)  one graph, all such graphs
                                                     of the process in one memory pool: they run one after another
The rollout's forwards have one signature per running count (methods/rollout.py: at most K*B sizes), each captured
the first time it is seen. The losses, the optimizer step (a bounded number of launches per bucket) and the rollout's
own maths stay eager. A call of any other form (keyword arguments, a non-tensor argument: a causal student's KV-cache
pass goes through `stream_forward` and never reaches `forward`) runs eager.

What capture needs, and where it comes from: no host work in the captured code (tests/test_host_syncs.py), shapes
known after warm-up (the same file), weights and gradients at fixed addresses (the parameters and their
`.grad` views never move: no offload, which is refused), and outputs consumed before the same signature runs again:
a graph writes its output into the same tensor at every replay, so a caller keeps a result only as something
computed from it (the trainers do; `EmulatedCapture`, the CPU tests' stand-in, overwrites the last output of a
signature in place when it runs again, so a cycle that kept one would differ from eager there).

Memory: a no-grad graph's pool holds its output (and the pool the largest intermediates of any of them); a graph
with grad keeps its own pool holding the activations its backward reads, for the run (per role and batch size).

Choice (`choose`): off unless asked. Asked on a CPU, or with a layout no graph can capture here (offload: the
weights leave the device between phases; TP, CP or sequence parallelism > 1: megatron-core's collectives inside a
captured graph are not tested here): a ConfigError naming the flag and the reason.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from typing import Callable, Iterable, Optional

import torch
from torch.utils._pytree import tree_leaves

from dmd2_mega.errors import ConfigError

WARMUP = 3
"""Eager runs of a signature on a side stream before its capture (cuDNN / cuBLAS and compiled code settle there)."""
_STATE = {"active": False, "sealed": False}
CAPTURED: collections.Counter = collections.Counter()
"""Graphs captured in this process, per (role, grad mode)."""
_NEW: list = []  # the signatures captured since the last `take_new()` after the seal


def choose(asked: bool, device: torch.device, *, offload: Iterable[str] = (), tp: int = 1, cp: int = 1,
           sp: bool = False) -> tuple[bool, str]:
    """(capture the cycle's model calls?, the start-up line's reason) for `--cuda-graphs` (`asked`) on this device
    and layout (module docstring)."""
    if not asked:
        return False, "off (--cuda-graphs to capture the cycle's model calls)"
    if device.type != "cuda":
        raise ConfigError("--cuda-graphs needs CUDA: a CPU has no graphs to capture; drop --cuda-graphs")
    offload = sorted(offload)
    blockers = [why for why, bad in (
        (f"offload ({', '.join(offload)}): a sleeping role's weights leave the device between phases, and a captured "
         f"graph reads them at fixed addresses; give --no-offload-inactive", bool(offload)),
        ("TP, CP or sequence parallelism > 1: megatron-core's collectives inside a captured graph are not tested "
         "here; run TP = CP = 1 or drop --cuda-graphs", tp > 1 or cp > 1 or sp)) if bad]
    if blockers:
        raise ConfigError(f"--cuda-graphs: {'; '.join(blockers)}")
    return True, "on (--cuda-graphs: each model call of a cycle replayed from its captured graph)"


class CudaCapture:
    """What captures on CUDA: `plain(fn, args)` a graph of fn without grad, `with_grad(module, args)` forward and
    backward graphs of module (its parameters' gradients flow to autograd). Each returns the replaying callable."""

    def __init__(self):
        self.pool = None

    def plain(self, fn: Callable, args: tuple) -> Callable:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static = tuple(a.clone() for a in args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*static)

        def replay(*inputs):
            for s, a in zip(static, inputs):
                s.copy_(a)
            graph.replay()
            return out
        return replay

    def with_grad(self, module: torch.nn.Module, args: tuple) -> Callable:
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        return torch.cuda.make_graphed_callables(module, sample, num_warmup_iters=WARMUP, allow_unused_input=True)


class EmulatedCapture:
    """The CPU tests' stand-in for `CudaCapture`: each call runs fn again (eager, autograd intact), and what a graph
    would do to its output is done to the previous output of the signature: it is overwritten in place with the
    new one (module docstring). A caller that kept an output across a second call of its signature then reads the
    new values (or autograd reports the in-place change), as it would read a graph's overwritten buffer."""

    def plain(self, fn: Callable, args: tuple) -> Callable:
        return self._replaying(fn)

    def with_grad(self, module: torch.nn.Module, args: tuple) -> Callable:
        return self._replaying(module)

    @staticmethod
    def _replaying(fn: Callable) -> Callable:
        last: list = []

        def replay(*inputs):
            out = fn(*inputs)
            leaves = tree_leaves(out)
            if last:
                with torch.no_grad():  # the old outputs "are" the graph's buffers: now they hold the new values
                    torch._foreach_copy_(last, [t.detach() for t in leaves])
            last[:] = leaves
            return out
        return replay


class _Call(torch.nn.Module):
    """One model's own forward as a module of its own (`make_graphed_callables` replaces the forward of the module
    it captures; the model keeps its own). Its parameters are the model's."""

    def __init__(self, model: torch.nn.Module, forward: Callable):
        super().__init__()
        self.model = model
        self._forward = forward

    def forward(self, *args):
        return self._forward(*args)


class GraphedForward:
    """A role's model's `forward`, routed (module docstring): inside `capturing`, a call of positional tensors runs
    the graph of its signature (captured on first sight by `capture`), any other call and every call outside runs
    the model's own forward."""

    def __init__(self, role: str, model: torch.nn.Module, capture):
        self.role, self.model, self.capture = role, model, capture
        self.eager = model.forward  # the bound forward of the model's class
        self.graphs: dict = {}

    def __call__(self, *args, **kwargs):
        if not _STATE["active"] or kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            return self.eager(*args, **kwargs)
        grad = torch.is_grad_enabled()
        key = (grad, self.model.training,
               tuple((tuple(a.shape), a.dtype, a.requires_grad, a.device) for a in args))
        run = self.graphs.get(key)
        if run is None:
            run = self.graphs[key] = self._capture(key, grad, args)
        return run(*args)

    def _capture(self, key: tuple, grad: bool, args: tuple) -> Callable:
        try:
            run = (self.capture.with_grad(_Call(self.model, self.eager), args) if grad else
                   self.capture.plain(self.eager, args))
        except Exception as e:  # a capture error leaves the device unusable for this run: stop, saying where
            raise RuntimeError(f"--cuda-graphs: capturing the {self.role}'s forward ({describe(key)}) failed: "
                               f"{type(e).__name__}: {e}; run without --cuda-graphs") from e
        CAPTURED[(self.role, grad)] += 1
        if _STATE["sealed"]:
            _NEW.append(f"{self.role} {describe(key)}")
        return run


def describe(key: tuple) -> str:
    grad, _, shapes = key
    return f"{shapes[0][0][0] if shapes and shapes[0][0] else '?'} rows, {'with' if grad else 'no'} grad"


def install(models: dict, capture=None) -> str:
    """Route the forward of each model of `models` ({role: module}) through a `GraphedForward` (`capture`: a
    `CudaCapture` by default); returns the start-up line's part naming the roles captured."""
    capture = capture or CudaCapture()
    seen: set = set()
    for role, model in models.items():
        if id(model) in seen:  # one model under two roles routes once
            continue
        seen.add(id(model))
        model.forward = GraphedForward(role, model, capture)
    return f"roles {', '.join(models)}"


def uninstall(models: Iterable[torch.nn.Module]) -> None:
    """Give each model its class's forward back (tests)."""
    for model in models:
        if isinstance(model.__dict__.get("forward"), GraphedForward):
            del model.forward


@contextlib.contextmanager
def capturing():
    """Inside: the installed models' calls run from their graphs (a cycle); outside they run eager (evaluation,
    checkpoints, samplers)."""
    was = _STATE["active"]
    _STATE["active"] = True
    try:
        yield
    finally:
        _STATE["active"] = was


def seal() -> None:
    """After the first cycle: later captures are reported by `take_new` (a rollout count not seen before)."""
    _STATE["sealed"] = True


def take_new() -> list:
    """The signatures captured since the last call after the seal (and forget them)."""
    out = list(_NEW)
    _NEW.clear()
    return out


def report_new(rank: int = 0) -> None:
    """One line for the captures of this cycle after the seal (none: nothing printed)."""
    new = take_new()
    if new and rank == 0:
        print(f"> cuda graphs: captured {len(new)} new ({'; '.join(new)}): {sum(CAPTURED.values())} graphs in all",
              file=sys.stderr, flush=True)


def reset() -> None:
    """Forget the counts and the seal (tests)."""
    CAPTURED.clear()
    _NEW.clear()
    _STATE.update(active=False, sealed=False)
