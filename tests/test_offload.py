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


def role_of(model, bf16: bool, table=None, name="student"):
    """A trained role as the trainers build it (a GradBuffer, the optimizer over it) with its Sleeper."""
    from dmd2_mega.methods.roles import Role
    from dmd2_mega.train.grad_buffer import GradBuffer
    grads = GradBuffer(model)
    opt = Optimizer(model, optim_cfg(bf16), grads=grads)
    return Role(name, model, opt, grads=grads).with_offload(torch.device("cpu"), table)


def _table(weights_alone: bool):
    from dmd2_mega.methods.base import Phase
    return (Phase("rollout", {"student": "all"}), Phase("critic", {"critic": "all"}, trains="critic"),
            Phase("actor", {"student": "all", **({"critic": "weights"} if weights_alone else {})}, trains="student"))


def trainer_step(role, step):
    """The trainers' order: backward, step, zero the grads; a phase boundary (sleep, wake) only after that."""
    x, y = data(step)
    dtype = next(role.model.parameters()).dtype
    loss = ((role.model(x.to(dtype)) + role.model.offset - y.to(dtype)).float() ** 2).mean()
    loss.backward()
    role.optimizer.step(loss)
    role.optimizer.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_trained_role_moves_12_bytes_per_parameter_each_way(bf16):
    """Issue 52 item 3: the main_grad buffer (zero at a phase boundary) is not copied but zeroed on a wake, and under
    --bf16 the bf16 weights are rebuilt from the fp32 masters: masters (the fp32 weights) and two Adam moments move,
    4 bytes each per parameter, plus Adam's step counter (4 bytes per tensor). The training is the same, bit for bit,
    as without offload."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    ref, role = role_of(tiny(dtype=dtype), bf16), role_of(tiny(dtype=dtype), bf16, _table(False))
    sl = role.sleeper
    assert bool(sl.derived) == bf16 and len(sl.zeroed) == 1
    for s in range(4):
        assert torch.equal(trainer_step(ref, s), trainer_step(role, s))
        sl.sleep()
        assert sl.resident_bytes() == 0
        sl.wake()
    params = [p for p in role.model.parameters()]
    n, tensors = sum(p.numel() for p in params), len(params)
    buffers = role.model.offset.nbytes
    c = sl.counters()
    want = 4 * (12 * n + 4 * tensors + buffers)  # 4 sleeps and 4 wakes
    assert c["d2h_bytes"] == c["h2d_bytes"] == want, (c, want)
    assert c["zeroed_bytes"] == 4 * sl.zeroed[0].untyped_storage().nbytes()
    # storages copied per sleep: bf16 the module buffer, the flat masters, moments and steps (`train/flat.py`);
    # fp32 each parameter (not flattened here: the trainers flatten a sleeping role's) and the buffer, moments, steps
    assert c["d2h_copies"] == c["h2d_copies"] == 4 * (4 if bf16 else tensors + 3)
    for a, b in zip(ref.model.parameters(), role.model.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad) and not b.grad.any()
    for a, b in zip(ref.optimizer.master_params, role.optimizer.master_params):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.optimizer.inner.state[a][k], role.optimizer.inner.state[b][k])


def test_weights_alone_keep_their_copy_and_a_derived_role_refuses_them():
    """A phase table that asks for a trained bf16 role's weights without its state (the GAN head's frozen critic)
    keeps copying them; where they are derived, asking for them alone is a clear error, never stale weights."""
    alone = role_of(tiny(dtype=torch.bfloat16), True, _table(True), "critic").sleeper  # the actor reads its weights
    assert alone.derived == [] and alone.derive is None
    alone.sleep()
    alone.set_resident("weights")
    assert alone.level == "weights"
    alone.wake()
    assert role_of(tiny(dtype=torch.bfloat16), True, _table(True), "student").sleeper.derived  # not the student
    derived = role_of(tiny(dtype=torch.bfloat16), True, _table(False)).sleeper
    derived.sleep()
    with pytest.raises(ValueError, match="derived from its optimizer state, which is asleep"):
        derived.set_resident("weights")
    assert derived.asleep
    derived.wake()
    unknown = role_of(tiny(dtype=torch.bfloat16), True, None).sleeper  # no table: copy, never derive
    assert unknown.derived == [] and unknown.derive is None


def test_a_time_sliced_dmd2_run_copies_a_few_storages_of_at_most_12_bytes_per_parameter(debug_teacher):
    """The trainer with --offload-inactive --bf16: a cycle moves, per trained role and direction, 12 bytes per
    trained parameter (plus Adam's 4-byte step per tensor and the module's buffers) in a handful of copies (its
    parameters flattened: `flat.flatten_parameters`), and its metrics and weights equal the run without offload, bit
    for bit."""
    from dmd2_mega.arguments import parse_dmd2_args
    from dmd2_mega.methods.dmd2.method import DMD2Trainer
    from tests.utils import world_of_one
    runs = {}
    for flag in ("--no-offload-inactive", "--offload-inactive"):
        with world_of_one():
            tr = DMD2Trainer(parse_dmd2_args([
                "--model-size", "debug", "--teacher-load", debug_teacher, "--micro-batch-size", "2",
                "--global-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2", "--train-iters", "3", "--bf16",
                flag]))
            tr.cycle()
            before = {n: r.sleeper.counters() for n, r in tr.roles.items() if r.sleeper is not None}
            metrics = tr.cycle()["metrics"]
            moved = {n: {k: v - before[n][k] for k, v in r.sleeper.counters().items()}
                     for n, r in tr.roles.items() if r.sleeper is not None}
            for r in tr.roles.values():  # the critic sleeps after a cycle: reading it needs it awake
                if r.sleeper is not None:
                    r.sleeper.wake()
            runs[flag] = ({k: v.clone() for k, v in metrics.items()},
                          [p.detach().clone() for n in ("student", "critic") for p in tr.roles[n].model.parameters()],
                          moved, {n: ([p for p in r.model.parameters() if p.requires_grad],
                                      sum(b.nbytes for b in r.model.buffers())) for n, r in tr.roles.items()})
    (m0, w0, _, _), (m1, w1, moved, params) = runs["--no-offload-inactive"], runs["--offload-inactive"]
    assert all(torch.equal(m0[k], m1[k]) for k in m0) and all(torch.equal(a, b) for a, b in zip(w0, w1))
    for name in ("student", "critic"):
        n, tensors, buffers = sum(p.numel() for p in params[name][0]), len(params[name][0]), params[name][1]
        c = moved[name]  # the module's buffers (the DiT's fixed position table) are copied as they are
        assert c["d2h_bytes"] == c["h2d_bytes"] == 12 * n + 4 * tensors + buffers, (name, c, n)
        assert c["d2h_copies"] == c["h2d_copies"] <= 4, (name, c)
    assert moved["teacher"]["d2h_bytes"] == 0 and moved["teacher"]["h2d_copies"] <= 2, moved["teacher"]


def test_prefetch_wakes_the_next_phases_roles_during_the_last_step(debug_teacher):
    """--offload-prefetch: the order of phases and wakes, recorded: the critic and the teacher wake inside the
    rollout phase (its last step) and the student inside the critic phase, before their phases start; the cycle's
    metrics and weights equal those without prefetch, bit for bit. Without offload the flag is one clear error."""
    from dmd2_mega.arguments import parse_dmd2_args
    from dmd2_mega.errors import ConfigError
    from dmd2_mega.methods.dmd2.method import DMD2Trainer
    from tests.utils import world_of_one
    args = ["--model-size", "debug", "--teacher-load", debug_teacher, "--micro-batch-size", "2",
            "--global-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2", "--train-iters", "3",
            "--offload-inactive"]
    with pytest.raises(ConfigError, match="--offload-prefetch has no effect without --offload-inactive"):
        parse_dmd2_args(args[:-1] + ["--offload-prefetch"])
    runs = {}
    for extra in ((), ("--offload-prefetch",)):
        with world_of_one():
            tr = DMD2Trainer(parse_dmd2_args(args + list(extra)))
            tr.cycle()
            events = []
            for name, r in tr.roles.items():
                real = r.sleeper.set_resident

                def recorded(level, name=name, real=real, sleeper=r.sleeper):
                    before = sleeper.level
                    out = real(level)
                    if sleeper.level != before:
                        events.append((name, sleeper.level))
                    return out
                r.sleeper.set_resident = recorded
            clock = tr.clock
            tr.clock = lambda phase: (events.append(("phase", phase)), clock(phase))
            tr.clock.end_cycle, tr.clock.take = clock.end_cycle, clock.take
            metrics = tr.cycle()["metrics"]
            seen = list(events)  # the cycle's (the wakes below, to read the weights, are not)
            for r in tr.roles.values():
                r.sleeper.wake()
            runs[bool(extra)] = (seen, {k: v.clone() for k, v in metrics.items()},
                                 [p.detach().clone() for r in tr.roles.values() for p in r.model.parameters()])
    (plain, m0, w0), (pre, m1, w1) = runs[False], runs[True]
    # the student stays awake from the last cycle's actor phase into the rollout
    assert plain == [("phase", "rollout"), ("phase", "critic"), ("student", "none"), ("critic", "all"),
                     ("teacher", "all"), ("phase", "actor"), ("critic", "none"), ("teacher", "none"),
                     ("student", "all")], plain
    assert pre == [("phase", "rollout"), ("critic", "all"), ("teacher", "all"), ("phase", "critic"),
                   ("student", "none"), ("student", "all"), ("phase", "actor"), ("critic", "none"),
                   ("teacher", "none")], pre
    assert all(torch.equal(m0[k], m1[k]) for k in m0) and all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_the_distributed_optimizers_role_keeps_copying_its_bf16_weights():
    """Its masters are this rank's shards, from which the bf16 weights cannot be rebuilt without an all-gather: a
    time-sliced role under it copies its weights (and still never its zero main_grad)."""
    from dmd2_mega.methods.roles import Role
    from dmd2_mega.train.dist_optim import DistributedOptimizer
    from dmd2_mega.train.grad_buffer import GradBuffer
    model = tiny(dtype=torch.bfloat16)
    grads = GradBuffer(model, shard=True)
    opt = DistributedOptimizer(model, optim_cfg(True), grads=grads)
    sl = Role("student", model, opt, grads=grads).with_offload(torch.device("cpu"), _table(False)).sleeper
    assert sl.derived == [] and sl.derive is None and len(sl.zeroed) == 1
    before = [p.detach().clone() for p in model.parameters()]
    sl.sleep()
    sl.wake()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_prefetch_wakes_a_role_of_experts_too():
    """`wake_ahead` reads a sleeper's level: a role of experts (Wan 2.2's teacher, `ExpertSleeper`) has one too."""
    from dmd2_mega.methods.base import Phase
    from dmd2_mega.methods.roles import Role, wake_ahead
    from dmd2_mega.train.offload import ExpertSleeper
    experts = [tiny(0), tiny(1)]
    role = Role("teacher", experts[0], sleeper=ExpertSleeper("teacher", experts))
    role.sleeper.set_resident("none")
    assert role.sleeper.level == "none" and role.sleeper.asleep
    wake_ahead("critic", {"teacher": role}, (Phase("critic", {"teacher": "all"}),))
    assert role.sleeper.level == "all"
    assert experts[1](torch.randn(1, 3)).shape == (1, 2)  # an expert wakes on its forward
