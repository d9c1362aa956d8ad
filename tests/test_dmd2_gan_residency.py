"""Time-slicing with the GAN head: in the actor phase the critic keeps exactly its weights resident.

Roles built as the trainer builds them (debug DiT, the critic a GANCritic (trunk + head), the
Megatron-style Optimizer, one training step taken so that grads, Adam state and, under --bf16, fp32
masters exist), each with a Sleeper. `enter_phase("actor", roles, GAN)` (DMD2's table with the head's roles):
the critic's resident bytes equal its parameters' + buffers' bytes (counted here from the module, independently of offload's
accounting), its grads / Adam state / masters are freed (storage nbytes 0), a frozen forward of the
head works and an optimizer step raises RoleAsleepError. Back in the critic phase every critic
tensor equals a clone taken before, bit for bit. The student's EMA sleeps and wakes with the
student, bit-exact. Without GAN the critic sleeps entirely in the actor
phase (DMD2's table without the GAN head's `phase_needs`).
"""
import pytest
import torch

from dmd2_mega.train.builders import build_model, cast_model
from dmd2_mega.config import ModelConfig, OptimConfig
from dmd2_mega.methods.ema import StudentEMA
from dmd2_mega.methods.base import phase_needs, with_needs
from dmd2_mega.methods.dmd2.gan import GANCritic, GANSettings
from dmd2_mega.methods.dmd2.phases import PHASES
from dmd2_mega.methods.roles import Role, enter_phase
from dmd2_mega.train.offload import RoleAsleepError
from dmd2_mega.train.optim import Optimizer
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)
INFO = {"in_channels": 1, "image_size": 8, "num_classes": 10, "cond_shape": None}
GAN = with_needs(PHASES, GANSettings.phase_needs)  # DMD2's table with the GAN head's roles


@pytest.fixture(scope="module")
def ps():
    with world_of_one() as state:
        yield state


def make_roles(ps, bf16: bool) -> tuple[dict, StudentEMA]:
    """(roles with Sleepers, the student's EMA)."""
    roles, ema = {}, None
    for name in ("student", "critic", "teacher"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(size="debug"), INFO, ps)
        if name == "critic":
            model = GANCritic(model, 1, seed=3)
        model = cast_model(model, bf16)
        opt = None
        if name != "teacher":
            opt = Optimizer(model, OptimConfig(lr=1e-3, bf16=bf16))
            x, s, y = torch.randn(4, 1, 8, 8), torch.rand(4), torch.arange(4)
            for i in range(2):  # a step, then grads present at the phase switch, so they must sleep too
                loss = model(x, s, y).float().square().mean()
                if name == "critic":
                    loss = loss + model.logits(x, s, y).square().mean()
                loss.backward()
                if i == 0:
                    opt.step()
        extra = ()
        if name == "student":  # the EMA lives beside the student, as the trainer builds it
            ema = StudentEMA(model, 0.9)
            extra = tuple(ema.tensors())
        roles[name] = Role(name, model, opt, extra=extra).with_offload(ps.device)
    return roles, ema


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_actor_phase_keeps_only_the_critics_weights(ps, bf16):
    roles, _ = make_roles(ps, bf16)
    critic = roles["critic"]
    assert phase_needs(GAN, "actor")["critic"] == "weights" and "critic" not in phase_needs(PHASES, "actor")
    enter_phase("critic", roles, GAN)
    before = [t.detach().clone() for t in critic.sleeper.tensors()]
    state = critic.sleeper.state_tensors()
    assert len(state) > len(list(critic.model.parameters())), "grads and Adam state exist"
    enter_phase("actor", roles, GAN)
    assert critic.sleeper.level == "weights"
    assert critic.resident_bytes() == weight_bytes(critic.model) > 0
    held = {p.untyped_storage().data_ptr() for p in critic.model.parameters()}
    for t in critic.sleeper.state_tensors():
        if t.untyped_storage().data_ptr() in held:  # without --bf16 the optimizer's params are the weights
            continue
        assert t.untyped_storage().nbytes() == 0, "grads / optimizer state of the critic stay resident"
    if bf16:  # the fp32 masters are the optimizer's, not the module's: asleep
        masters = [p for g in critic.optimizer.inner.param_groups for p in g["params"]]
        assert all(m.dtype == torch.float32 and m.untyped_storage().nbytes() == 0 for m in masters)
    assert roles["teacher"].resident_bytes() == 0
    x, s, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    assert critic.model.logits(x, s, y).shape == (2,)  # the frozen forward runs
    with pytest.raises(RoleAsleepError, match="critic is asleep .*state"):
        critic.optimizer.step()
    enter_phase("critic", roles, GAN)
    after = critic.sleeper.tensors()
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert a.dtype == b.dtype and torch.equal(a, b), "critic tensor changed across the actor phase"


def test_student_ema_sleeps_with_the_student(ps):
    roles, ema = make_roles(ps, False)
    with torch.no_grad():
        for t in ema.shadow:
            t.add_(0.5)  # an EMA that differs from the weights
    before = [t.clone() for t in ema.shadow]
    enter_phase("critic", roles, GAN)  # the student is not needed: weights, state and EMA sleep
    assert roles["student"].resident_bytes() == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in ema.shadow)
    enter_phase("rollout", roles, GAN)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, before))


def test_without_gan_the_critic_sleeps_in_the_actor_phase(ps):
    roles, _ = make_roles(ps, False)
    enter_phase("actor", roles, PHASES)
    assert roles["critic"].resident_bytes() == 0 and roles["critic"].sleeper.asleep
    with pytest.raises(RoleAsleepError, match="critic is asleep"):
        roles["critic"].model(torch.randn(1, 1, 8, 8), torch.rand(1), torch.tensor([0]))
    enter_phase("actor", roles, GAN)  # asleep -> weights only: the weights come back
    assert roles["critic"].sleeper.level == "weights"
    assert roles["critic"].resident_bytes() == weight_bytes(roles["critic"].model)
