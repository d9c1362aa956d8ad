"""Sleep / wake of a role (dmd2_mega/train/offload.py) on a CPU-only run, where the "device" is the CPU.

Checked against independent snapshots (clones taken before sleeping) and a run without offload:
storages are freed (nbytes 0) while the tensor objects survive in the model and the optimizer;
waking restores params, grads, Adam state and fp32 masters bit-exactly; training with sleep/wake
between phases equals training without, bit for bit; shared-storage views come back as views;
a forward or optimizer step while asleep raises RoleAsleepError.
"""
import pytest
import torch

from dmd2_mega.config import OptimConfig
from dmd2_mega.train.offload import RoleAsleepError, Sleeper, resident_bytes
from dmd2_mega.train.optim import Optimizer

pytestmark = pytest.mark.timeout(60)


def tiny(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.GELU(), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    m.register_buffer("offset", torch.randn(2))
    return m.to(dtype)


def data(step, n=7):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)


def train_step(model, opt, step, role=None):
    opt.zero_grad()
    x, y = data(step)
    dtype = next(model.parameters()).dtype
    loss = ((model(x.to(dtype)) + model.offset - y.to(dtype)).float() ** 2).mean()
    loss.backward()
    if role is not None:  # a phase boundary between backward and step: grads sleep too
        role.sleep()
        role.wake()
    opt.step()
    if role is not None:
        role.sleep()
        role.wake()
    return loss.detach()


def snapshot(sleeper):
    return [t.detach().clone() for t in sleeper.tensors()]


def optim_cfg(bf16=False):
    return OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, bf16=bf16)


def test_sleep_frees_storage_and_keeps_objects():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    role = Sleeper("critic", [model], [opt])
    params = list(model.parameters())
    expect = sum(p.nbytes for p in params) * 4 + model.offset.nbytes + 4 * len(params)  # p, grad, 2 moments; step
    assert role.resident_bytes() == expect
    before = snapshot(role)
    ids = [id(t) for t in role.tensors()]
    state_ids = {id(p): {k: id(v) for k, v in opt.state[p].items()} for p in params}
    grad_ids = [id(p.grad) for p in params]

    assert role.sleep() == expect
    assert role.asleep and role.resident_bytes() == 0 and resident_bytes(role.tensors()) == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in role.tensors())
    assert [id(t) for t in role.tensors()] == ids
    assert [id(p.grad) for p in model.parameters()] == grad_ids
    assert {id(p): {k: id(v) for k, v in opt.state[p].items()} for p in params} == state_ids
    assert params[0].shape == (5, 3)  # metadata survives

    assert role.wake() == expect
    assert not role.asleep and role.resident_bytes() == expect
    after = role.tensors()
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for p in params:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-masters"])
def test_wake_is_bit_exact_with_megatron_style_optimizer(bf16):
    model = tiny(dtype=torch.bfloat16 if bf16 else torch.float32)
    opt = Optimizer(model, optim_cfg(bf16))
    for s in range(2):
        train_step(model, opt, s)
    role = Sleeper("student", [model], [opt])
    masters = [m.detach().clone() for m in opt.master_params]
    state = {i: {k: v.clone() for k, v in opt.inner.state[m].items()} for i, m in enumerate(opt.master_params)}
    grads = [p.grad.clone() for p in model.parameters()]
    before = snapshot(role)
    role.sleep()
    assert all(m.untyped_storage().nbytes() == 0 for m in opt.master_params)
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert role.resident_bytes() == 0
    role.wake()
    assert opt.mixed == bf16
    for m, saved in zip(opt.master_params, masters):
        assert m.dtype == torch.float32 and torch.equal(m, saved)
    for i, m in enumerate(opt.master_params):
        for k, v in opt.inner.state[m].items():
            assert torch.equal(v, state[i][k]), k
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    for a, b in zip(role.tensors(), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-masters"])
def test_training_with_offload_equals_training_without(bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    ref_model, off_model = tiny(dtype=dtype), tiny(dtype=dtype)
    ref_opt, off_opt = Optimizer(ref_model, optim_cfg(bf16)), Optimizer(off_model, optim_cfg(bf16))
    role = Sleeper("student", [off_model], [off_opt])
    ref_losses = torch.stack([train_step(ref_model, ref_opt, s) for s in range(5)])
    off_losses = torch.stack([train_step(off_model, off_opt, s, role) for s in range(5)])
    assert torch.equal(ref_losses, off_losses)
    assert not torch.equal(ref_losses[0], ref_losses[-1])  # it did train
    for a, b in zip(ref_model.parameters(), off_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref_opt.master_params, off_opt.master_params):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.inner.state[a][k], off_opt.inner.state[b][k])


def test_shared_storage_views_restored():
    flat = torch.randn(23)
    a, b = flat[:6].view(2, 3), flat[6:].view(17)
    stride_view = flat[1::4]
    role = Sleeper("teacher", tensors=[a, b, stride_view, flat])
    assert role.resident_bytes() == flat.nbytes == resident_bytes([a, b, stride_view])  # counted once
    ref = flat.clone()
    assert role.sleep() == flat.nbytes
    assert flat.untyped_storage().nbytes() == 0 and a.untyped_storage().nbytes() == 0
    role.wake()
    assert torch.equal(flat, ref) and torch.equal(a, ref[:6].view(2, 3)) and torch.equal(stride_view, ref[1::4])
    flat[0] = 42.0  # still views of one storage
    assert a[0, 0] == 42.0 and a.data_ptr() == flat.data_ptr() and b.data_ptr() == flat.data_ptr() + 24


def test_grads_in_one_flat_buffer_like_ddp():
    model = tiny()
    params = list(model.parameters())
    flat = torch.randn(sum(p.numel() for p in params))
    off = 0
    for p in params:  # DDP-style bucket: each .grad is a view into one flat buffer
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    role = Sleeper("critic", [model])
    expect = sum(p.nbytes for p in params) + flat.nbytes + model.offset.nbytes
    assert role.resident_bytes() == expect
    ref = flat.clone()
    role.sleep()
    assert role.resident_bytes() == 0
    role.wake()
    assert torch.equal(flat, ref)
    flat.zero_()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in params)


def test_forward_and_step_while_asleep_raise():
    model = tiny()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mega_model = tiny(1)
    mega_opt = Optimizer(mega_model, optim_cfg())
    train_step(model, torch_opt, 0)
    train_step(mega_model, mega_opt, 0)
    role, role2 = Sleeper("critic", [model], [torch_opt]), Sleeper("student", [mega_model], [mega_opt])
    role.sleep()
    role2.sleep()
    with pytest.raises(RoleAsleepError, match="role critic is asleep"):
        model(torch.randn(2, 3))
    with pytest.raises(RoleAsleepError, match="role critic is asleep.*optimizer step"):
        torch_opt.step()
    with pytest.raises(RoleAsleepError, match="role student is asleep.*optimizer step"):
        mega_opt.step()
    with pytest.raises(RoleAsleepError, match="close"):
        role.close()
    role.wake()
    role2.wake()
    out = model(torch.randn(2, 3))
    assert out.shape == (2, 2)
    torch_opt.step()
    mega_opt.step()
    role2.close()  # guards removed: the plain method is back
    assert "step" not in vars(mega_opt)


def test_repeated_calls_are_noops_and_roles_are_independent():
    critic, student = tiny(0), tiny(1)
    rc, rs = Sleeper("critic", [critic]), Sleeper("student", [student])
    ref = [p.detach().clone() for p in critic.parameters()]
    total = rs.resident_bytes()
    assert rc.wake() == 0  # awake already
    assert rc.sleep() > 0 and rc.sleep() == 0
    assert rc.resident_bytes() == 0 and rs.resident_bytes() == total
    assert student(torch.randn(1, 3)).shape == (1, 2)  # the other role runs
    assert rc.wake() > 0 and rc.wake() == 0
    assert all(torch.equal(p, r) for p, r in zip(critic.parameters(), ref))


def test_frozen_role_copies_to_the_host_once():
    """The teacher's host copy is made at its first sleep; later sleeps only free, wakes are one copy back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    frozen = Sleeper("teacher", [model], frozen=True)
    frozen.sleep()
    assert frozen.copied_bytes == nbytes
    for cycle in range(3):
        frozen.wake()
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items()), f"cycle {cycle}"
        frozen.sleep()
    assert frozen.copied_bytes == nbytes + 3 * nbytes, "sleeps after the first must not copy"
    frozen.wake()
    frozen.close()
    other = torch.nn.Linear(16, 8)
    trained = Sleeper("critic", [other])
    for _ in range(2):
        trained.sleep()
        trained.wake()
        with torch.no_grad():
            other.weight.add_(1.0)  # a trained role changes: every sleep copies
    assert trained.copied_bytes == 4 * nbytes
    before = other.weight.detach().clone()
    trained.sleep()
    trained.wake()
    assert torch.equal(other.weight, before)  # the latest values came back, not the first sleep's
    trained.close()
