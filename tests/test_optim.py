"""LR schedule, gradient norm/clipping and the bf16 master-weight optimizer against plain maths."""
import math

import pytest
import torch

from dmd2_mega.config import OptimConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.train.optim import LRSchedule, Optimizer, clip_gradients, grad_norm


def test_lr_schedule_warmup_cosine_constant():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_iters=10)
    s = LRSchedule(cfg, train_iters=110)
    assert s(0) == pytest.approx(1e-4) and s(9) == pytest.approx(1e-3)
    mid = 10 + 50
    assert s(mid) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert s(110) == pytest.approx(1e-5) and s(500) == pytest.approx(1e-5)
    lrs = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    const = LRSchedule(OptimConfig(lr=3e-4, lr_decay_style="constant", lr_warmup_iters=2), 100)
    assert const(1) == pytest.approx(3e-4) and const(99) == pytest.approx(3e-4)


def test_bad_optim_flags_name_the_flag():
    with pytest.raises(ConfigError, match="--min-lr"):
        OptimConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        OptimConfig(lr_decay_style="linear-ish")


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=dtype)), torch.nn.Parameter(torch.randn(7, dtype=dtype))]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def test_grad_norm_and_clip_match_float64():
    ps = _params()
    ref = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in ps))
    assert grad_norm(ps).item() == pytest.approx(ref, rel=1e-6)
    before = [p.grad.clone() for p in ps]
    norm = clip_gradients(ps, max_norm=ref / 4)
    assert norm.item() == pytest.approx(ref, rel=1e-6)
    assert grad_norm(ps).item() == pytest.approx(ref / 4, rel=1e-4)
    for p, b in zip(ps, before):  # clipping scales, never rotates
        torch.testing.assert_close(p.grad, b / 4, rtol=1e-4, atol=1e-7)
    ps2 = _params()
    clip_gradients(ps2, max_norm=10 * ref)  # under the threshold: untouched
    for p, b in zip(ps2, _params()):
        torch.testing.assert_close(p.grad, b.grad)


def test_bf16_master_weights_step_like_fp32_adamw():
    """bf16 params + fp32 masters: the masters follow fp32 AdamW exactly, params are their rounding."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(model.weight.float())
        ref.bias.copy_(model.bias.float())
    cfg = OptimConfig(lr=1e-2, clip_grad=0.0, weight_decay=0.1)
    opt, ref_opt = Optimizer(model, cfg), Optimizer(ref, cfg)
    assert opt.mixed and not ref_opt.mixed
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    for _ in range(3):
        g = torch.randn(4, 8)
        model.weight.grad, model.bias.grad = g.to(torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
        ref.weight.grad, ref.bias.grad = g.to(torch.bfloat16).float(), torch.zeros(4)
        opt.step(), ref_opt.step()
    for m, r in zip(opt.master_params, (ref.weight, ref.bias)):  # exactly: the same fp32 AdamW maths
        torch.testing.assert_close(m, r, rtol=0, atol=0)
    torch.testing.assert_close(model.weight, ref.weight.to(torch.bfloat16), rtol=0, atol=0)
    state = opt.state_dict()
    opt2 = Optimizer(torch.nn.Linear(8, 4).to(torch.bfloat16), cfg)
    opt2.load_state_dict(state)
    torch.testing.assert_close(opt2.master_params[0], opt.master_params[0], rtol=0, atol=0)
    assert opt2.inner.state_dict()["state"][0]["step"] == 3
    with pytest.raises(ValueError, match="--bf16"):
        ref_opt.load_state_dict(state)


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed"])
def test_masters_follow_weights_loaded_after_the_optimizer(distributed):
    """--load with --no-load-optim loads weights into a model whose optimizer already holds fp32 masters: after
    sync_masters a step with zero gradients keeps the loaded weights (without it, the step restores the init)."""
    from dmd2_mega.train.dist_optim import DistributedOptimizer
    from dmd2_mega.train.grad_buffer import GradBuffer
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    grads = GradBuffer(model, shard=distributed)
    opt = (DistributedOptimizer if distributed else Optimizer)(model, OptimConfig(lr=1e-2, bf16=True), grads=grads)
    loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    opt.sync_masters()
    opt.step()  # zero gradients: Adam's update is 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded[k]), k


def _trained(dtype, distributed=False, clip=1e-3, steps=3, seed=0, state=None):
    """A small model of odd sizes stepped `steps` times through its GradBuffer (2 micro-batches a step, lr from an
    LRSchedule with warmup); `state`: an optimizer state to load first. Returns (model, optimizer)."""
    from dmd2_mega.train.dist_optim import DistributedOptimizer
    from dmd2_mega.train.grad_buffer import GradBuffer
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3)).to(dtype)
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, clip_grad=clip, weight_decay=0.1)
    grads = GradBuffer(model, shard=distributed)
    opt = (DistributedOptimizer if distributed else Optimizer)(model, cfg, grads=grads)
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = state["it"]
    schedule = LRSchedule(cfg, 10)
    for it in range(first, first + steps):
        schedule.apply(opt, it)
        for j in range(2):
            g = torch.Generator().manual_seed(100 * it + j)
            x, y = torch.randn(3, 7, generator=g).to(dtype), torch.randn(3, 3, generator=g)
            with grads.no_sync() if j == 0 else torch.enable_grad():
                ((model(x).float() - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed"])
def test_lr_is_one_device_tensor_filled_in_place(distributed):
    model, opt = _trained(torch.float32, distributed, steps=1)
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(torch.is_tensor(t) and t.dtype == torch.float32 and t.dim() == 0 for t in lrs)
    cfg = OptimConfig(lr=1e-2, lr_decay_style="constant")
    assert LRSchedule(cfg, 10).apply(opt, 5) == 1e-2  # the float, for the log line
    assert [g["lr"] for g in opt.param_groups] == lrs and all(t is g["lr"] for t, g in zip(lrs, opt.param_groups))
    assert all(float(t) == torch.tensor(1e-2, dtype=torch.float32).item() for t in lrs)
    state = opt.state_dict()
    assert all(type(g["lr"]) is float for g in state["inner"]["param_groups"])  # checkpoints hold a float, as before
    state["inner"]["param_groups"][0]["lr"] = 0.25  # a checkpoint's value (an older one: a float)
    opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] is lrs[0] and float(lrs[0]) == 0.25  # loaded into the same tensor


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_through_the_buffer_is_bit_exact(dtype, distributed):
    """Bit-exact: 2 steps, state saved, 2 more into fresh objects = 4 steps straight (lr tensor, moments, masters)."""
    straight, _ = _trained(dtype, distributed, steps=4)
    first, opt = _trained(dtype, distributed, steps=2)
    state = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "optimizer": opt.state_dict(), "it": 2}
    resumed, _ = _trained(dtype, distributed, steps=2, seed=1, state=state)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [1e-3, 1e3], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_buffer_step_equal_to_the_per_parameter_path(dtype, clip):
    """The optimizer on its GradBuffer (the norm of the whole buffer in one launch, clip = one multiply of it, lr a
    tensor) against the same optimizer fed each parameter's `.grad` (per-tensor norms summed, foreach clip over the
    tensors), with the lr given as the float the tensor holds (fp32-rounded). Unclipped (the norm read only by the
    non-finite test): bit-exact. Clipped at every step: the two norms sum the same squares in another order, so
    the coefficient, and through it the weights, agree to a few ulps of the model's dtype."""
    from dmd2_mega.train.grad_buffer import bind_grad
    model, opt = _trained(dtype, clip=clip, steps=3)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3)).to(dtype)
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, clip_grad=clip, weight_decay=0.1)
    ref_opt, schedule = Optimizer(ref, cfg), LRSchedule(cfg, 10)
    for it in range(3):
        for g in ref_opt.param_groups:  # the per-parameter path of before: a float lr (the tensor's value)
            g["lr"] = torch.tensor(schedule(it), dtype=torch.float32).item()
        main = [torch.zeros(p.shape) for p in ref.parameters()]
        for j in range(2):
            gen = torch.Generator().manual_seed(100 * it + j)
            x, y = torch.randn(3, 7, generator=gen).to(dtype), torch.randn(3, 3, generator=gen)
            ((ref(x).float() - y) ** 2).mean().backward()
            for p, m in zip(ref.parameters(), main):
                m.add_(p.grad)
                p.grad = None
        for p, m in zip(ref.parameters(), main):  # the fp32 sums as .grad (a bf16 parameter's too: no rounding)
            bind_grad(p, m)
        ref_opt.step()
        ref_opt.zero_grad()
    eps = torch.finfo(dtype).eps
    for a, b in zip(model.parameters(), ref.parameters()):
        if clip > 1:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * float(b.abs().max()))


def test_non_finite_flag_of_every_norm_and_loss():
    """The skip flag (one test of norm + loss) against isfinite of each: every pairing of a finite, +inf, -inf and
    NaN norm and loss (a loss of several elements too: any non-finite element), and no loss."""
    model, opt = _trained(torch.float32, steps=1)
    values = [1.5, float("inf"), float("-inf"), float("nan")]
    for norm in values:
        n = torch.tensor(norm)
        assert bool(opt._non_finite(n, None)) == (not math.isfinite(norm))
        for loss in values + [[2.0, float("-inf")], [0.5, 3.0]]:
            l_ = torch.tensor(loss)
            want = not (math.isfinite(norm) and bool(torch.isfinite(l_).all()))
            assert bool(opt._non_finite(n, l_)) == want, (norm, loss)
