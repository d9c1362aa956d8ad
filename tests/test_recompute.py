"""--recompute-granularity full uses torch's non-reentrant checkpoint on every device:
  * with CUDA reported present (megatron_compat.cuda_available patched True) and megatron-core's
    reentrant `tensor_parallel.checkpoint` patched to fail, a recomputing GANCritic still runs the
    critic step's one forward (velocity + logits, two checkpointed passes through the same blocks) and
    the actor's `backward(inputs=student params)` through the frozen recomputing critic;
  * the gradients equal those of the same models without recompute (float64), and the critic's
    parameters receive no gradient from the actor's backward.
"""

import pytest
import torch
from megatron.core import tensor_parallel

from dmd2_mega.distributed import megatron_compat
from dmd2_mega.config import ModelConfig
from dmd2_mega.methods.dmd2.gan import GANCritic
from dmd2_mega.models import DataShape, build_model
from tests.utils import world_of_one

F64 = torch.float64
SHAPE = DataShape(1, 8, num_classes=10)


@pytest.fixture(scope="module", autouse=True)
def ps():
    with world_of_one() as state:
        yield state


def models(recompute: bool):
    torch.manual_seed(0)
    opts = ModelConfig(size="debug", recompute_granularity="full" if recompute else None).options()
    student = build_model("debug", SHAPE, options=opts).double()
    critic = GANCritic(build_model("debug", SHAPE, options=opts), layer=1, seed=3).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in list(student.parameters()) + list(critic.parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=F64))
    return student.train(), critic.train()


def run(student, critic):
    g = torch.Generator().manual_seed(2)
    x, s, y = torch.randn(4, 1, 8, 8, generator=g, dtype=F64), torch.rand(4, generator=g), torch.arange(4)
    v, fake, real = critic(x, s, y, extra=(x.flip(0), s.flip(0), y))  # the critic step's one forward
    (v.square().mean() + fake.square().mean() + real.square().mean()).backward()
    critic_grads = {n: p.grad.clone() for n, p in critic.named_parameters()}
    critic.zero_grad()
    x0hat = x - s.to(F64).view(-1, 1, 1, 1) * student(x, s, y)  # the actor: through the frozen critic
    inputs = list(student.parameters())
    (x0hat.square().mean() + critic.logits(x0hat, s, y).mean()).backward(inputs=inputs)
    assert all(p.grad is None for p in critic.parameters()), "the actor's backward reached the critic"
    return critic_grads, {n: p.grad.clone() for n, p in student.named_parameters()}


def test_recompute_is_non_reentrant_on_cuda_too_and_exact(monkeypatch):
    ref = run(*models(recompute=False))
    monkeypatch.setattr(megatron_compat, "cuda_available", lambda: True)

    def reentrant(*a, **k):
        raise AssertionError("megatron's reentrant checkpoint was used")
    monkeypatch.setattr(tensor_parallel, "checkpoint", reentrant)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: (calls.append(k.get("use_reentrant")), real(*a, **k))[1])
    got = run(*models(recompute=True))
    assert calls and set(calls) == {False}, calls
    for want, have in zip(ref, got):
        for n, gr in want.items():
            torch.testing.assert_close(have[n], gr, rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")


def test_no_checkpoint_wrapper_in_eval_mode_or_without_grad(monkeypatch):
    """Nothing is recomputed in eval mode or under no_grad (the rollout runs the student in train mode)."""
    student, _ = models(recompute=True)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x, s, y = torch.randn(2, 1, 8, 8, dtype=F64), torch.rand(2), torch.arange(2)
    with torch.no_grad():
        student(x, s, y)
    student.eval()
    student(x, s, y)
    assert not calls
    student.train()
    student(x, s, y)
    assert len(calls) == student.spec.num_layers
