"""One launch per buffer, not per parameter (issue 51, item 2): what the gradient buffer, the optimizer step and the
EMA cost does not grow with the number of parameter tensors.

  a. No hook: a GradBuffer registers no Python hook on any parameter, and the Python calls of a backward (counted
     with sys.setprofile) are the same for a model of 4 and of 40 parameter tensors.
  b. The aten ops (every op a TorchDispatchMode sees, views included) of a backward into the buffer are exactly
     those of autograd's own accumulation into defined `.grad`s (one in-place add per parameter, which autograd
     makes with or without the buffer): the buffer adds none.
  c. The aten ops of the rest of an optimizer step (finish, norm, clip, fused AdamW, bf16 write-back, zero_grad,
     the LR schedule) and of an EMA update are the same for 4 and 40 parameter tensors, fp32 and bf16.
"""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmd2_mega.config import OptimConfig
from dmd2_mega.methods.ema import StudentEMA
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.train.optim import LRSchedule, Optimizer

DTYPES = [torch.float32, torch.bfloat16]


class Ops(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> int:
    with Ops() as ops:
        fn()
    return ops.n


def count_python_calls(fn) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def model_of(tensors: int, dtype) -> torch.nn.Module:
    """tensors / 2 linears of odd size (a weight and a bias each)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(5, 5) for _ in range(tensors // 2)]).to(dtype)


def loss_of(model, dtype):
    return model(torch.randn(3, 5).to(dtype)).float().square().mean()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_no_hook_and_python_calls_independent_of_parameters(dtype):
    calls = {}
    for n in (4, 40):
        model = model_of(n, dtype)
        gb = GradBuffer(model)
        for p in model.parameters():
            assert not p._post_accumulate_grad_hooks and not p._backward_hooks
            assert p.grad is p.main_grad
        loss_of(model, dtype).backward()  # warm-up
        loss = loss_of(model, dtype)
        calls[n] = count_python_calls(loss.backward)
        assert gb.bound()
    assert calls[4] == calls[40], calls


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backward_ops_are_autograds_own_accumulation(dtype):
    model, plain = model_of(40, dtype), model_of(40, dtype)
    GradBuffer(model)
    loss_of(plain, dtype).backward()  # .grad defined: autograd accumulates in place from now on
    torch.manual_seed(1)
    ours = count_ops(lambda: loss_of(model, dtype).backward())
    torch.manual_seed(1)
    autograd = count_ops(lambda: loss_of(plain, dtype).backward())
    assert ours == autograd, (ours, autograd)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_step_and_ema_ops_independent_of_parameters(dtype):
    got = {}
    for n in (4, 40):
        model = model_of(n, dtype)
        grads = GradBuffer(model)
        cfg = OptimConfig(lr=1e-2, clip_grad=1e-3, lr_warmup_iters=3)
        opt, schedule = Optimizer(model, cfg, grads=grads), LRSchedule(cfg, 10)
        ema, tracking = StudentEMA(model, 0.9), StudentEMA(model, 0.9, start_iter=5)

        def step(it):
            schedule.apply(opt, it)
            opt.step()
            opt.zero_grad()

        loss_of(model, dtype).backward()
        step(0)  # the first step makes AdamW's state
        loss_of(model, dtype).backward()
        got[n] = {"step": count_ops(lambda: step(1)), "ema": count_ops(lambda: ema.update(2)),
                  "ema before start_iter": count_ops(lambda: tracking.update(1))}
    assert got[4] == got[40], got
