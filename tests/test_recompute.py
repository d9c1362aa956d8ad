"""--recompute-granularity (`models/recompute.py`) uses torch's non-reentrant checkpoint on every device:
  * with CUDA reported present (megatron_compat.cuda_available patched True) and megatron-core's
    reentrant `tensor_parallel.checkpoint` patched to fail, a recomputing (full, selective) GANCritic still runs the
    critic step's one forward (velocity + logits, two checkpointed passes through the same blocks) and
    the actor's `backward(inputs=student params)` through the frozen recomputing critic;
  * the gradients equal those of the same models without recompute (float64), and the critic's
    parameters receive no gradient from the actor's backward;
  * per family (DiT, Wan, the causal Wan's parallel pass) and granularity (selective, full): the velocity and every
    gradient equal no recompute's (float64, 1e-12 relative: the same arithmetic rerun), the backward reruns no
    attention under selective and each one under full, and a stateful mixer (the KV-cached stream) is never
    checkpointed.
"""

import pytest
import torch
from megatron.core import tensor_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from dmd2_mega.distributed import megatron_compat
from dmd2_mega.config import ModelConfig
from dmd2_mega.methods.dmd2.gan import GANCritic
from dmd2_mega.models import BuildOptions, DataShape, build_model, recompute
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan import WanSpec
from dmd2_mega.models.wan.family import WanFamily
from tests.utils import world_of_one

F64 = torch.float64
SHAPE = DataShape(1, 8, num_classes=10)


@pytest.fixture(scope="module", autouse=True)
def ps():
    with world_of_one() as state:
        yield state


def models(recompute):
    """(student, GAN critic) of the debug DiT, float64, recomputing as `recompute` says (a granularity or a bool)."""
    torch.manual_seed(0)
    how = {True: "full", False: None}.get(recompute, recompute)
    opts = ModelConfig(size="debug", recompute_granularity=how).options()
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


@pytest.mark.parametrize("how", ["full", "selective"])
def test_recompute_is_non_reentrant_on_cuda_too_and_exact(monkeypatch, how):
    ref = run(*models(recompute=False))
    monkeypatch.setattr(megatron_compat, "cuda_available", lambda: True)

    def reentrant(*a, **k):
        raise AssertionError("megatron's reentrant checkpoint was used")
    monkeypatch.setattr(tensor_parallel, "checkpoint", reentrant)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: (calls.append(k.get("use_reentrant")), real(*a, **k))[1])
    got = run(*models(recompute=how))
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


# ---- every family at every granularity ---------------------------------------------------------------------------

WAN = WanSpec("recompute-test", num_heads=2, head_dim=12, num_layers=2, ffn_dim=32, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=16, patch_size=(1, 2, 2), rope_max_seq_len=64)
ATTENTION_CALLS = {"dit": 2, "wan": 4, "causal-wan": 8}  # per layer: 1; self + cross; a self per chunk (3) + cross


def family_model(name: str, how: str):
    """(float64 model in training mode, inputs): the same perturbed weights and inputs for every granularity; the causal
    Wan's parallel pass (chunks of 1 frame, a level per chunk) runs the stateless block-causal mixer."""
    torch.manual_seed(0)
    opts = BuildOptions(recompute=how, causal=CausalLayout(chunk_frames=1) if name == "causal-wan" else None)
    g = torch.Generator().manual_seed(1)
    if name == "dit":
        m = build_model("debug", DataShape(4, 6, num_classes=10), options=opts)
        inputs = (torch.randn(3, 4, 6, 6, generator=g, dtype=F64), torch.rand(3, generator=g), torch.arange(3))
    else:
        m = WanFamily().build(WAN, DataShape(4, (3, 4, 6), cond_shape=(3, 16)), options=opts)
        sigma = torch.rand(3, 3, generator=g) if name == "causal-wan" else torch.rand(3, generator=g)
        inputs = (torch.randn(3, 4, 3, 4, 6, generator=g, dtype=F64), sigma, torch.randn(3, 3, 16, generator=g,
                                                                                          dtype=F64))
    with torch.no_grad():
        for p in m.parameters():  # nothing zero-initialised stays zero
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.double().train(), inputs


class AttentionCalls(TorchDispatchMode):
    """Counts the forward attention ops dispatched (the ops selective keeps: `recompute.kept`, not their backward)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += recompute.kept(func) and "backward" not in str(func)
        return func(*args, **(kwargs or {}))


def grads_and_reruns(model, inputs) -> tuple:
    """([v, dx, every parameter's grad], forward attention ops its backward ran)."""
    x = inputs[0].clone().requires_grad_(True)
    v = model(x, *inputs[1:])
    with AttentionCalls() as calls:
        (v * torch.linspace(-1, 1, v.numel(), dtype=F64).view(v.shape)).sum().backward()
    return [v.detach(), x.grad] + [p.grad for p in model.parameters()], calls.n


@pytest.mark.parametrize("how", ["selective", "full"])
@pytest.mark.parametrize("name", ["dit", "wan", "causal-wan"])
def test_every_family_and_granularity_equals_no_recompute(name, how):
    want, none_reruns = grads_and_reruns(*family_model(name, "none"))
    got, reruns = grads_and_reruns(*family_model(name, how))
    assert none_reruns == 0 and reruns == {"selective": 0, "full": ATTENTION_CALLS[name]}[how], reruns
    assert len(got) == len(want) and all(w is not None for w in want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * float(b.abs().max()), msg=lambda m: f"{i}: {m}")


@pytest.mark.parametrize("how", ["selective", "full"])
def test_a_stateful_mixer_is_never_checkpointed(how, monkeypatch):
    """The KV-cached stream with grad (a replayed chunk) runs its blocks plain: a rerun would read another cache."""
    model, (x, sigma, cond) = family_model("causal-wan", how)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    cache = model.new_cache()
    model.stream_forward(x[:, :, :1], sigma[:, 0], cond, cache, write=True).sum().backward()
    assert not calls
    model(x, sigma, cond)  # the parallel pass (stateless mixer) does checkpoint each block
    assert len(calls) == WAN.num_layers
