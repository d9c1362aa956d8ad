"""The GAN head inside the critic and actor phases, against float64 replays written here.

Critic with a head: the package's GANCritic (layer 0) around TinyTrunk = TinyNet plus
features(x, sigma, c, 0) = its hidden layer h = tanh(W1 x + table[c] + sigma w_s) [B, 5], in float64;
forward(x, sigma, c, gan_inputs=(x', sigma', c')) returns (v, head(features(x'))).
Critic step k, micro j (generator of j, after the flow-matching draws idx, eps):
    idx' ~ randint(#score choices, 2B), eps' ~ randn(2B, ...):  x' = (1 - s') [x0hat; real] + s' eps'
    (--no-dmd2-gan-noise: x' = [x0hat; real], s' = 0, nothing drawn)
    L = mean_n fm_n + w_D (mean softplus(D(x'_fake)) + mean softplus(-D(x'_real)))
The recorded gradients of step k equal autograd of (1/M) sum_j L at the recorded parameters.
Actor, micro j (actor generator of j): x0hat = x - sigma v_S(x);  x' = (1 - s') x0hat + s' eps'
(idx' then eps' drawn); L = DMD + w_G mean softplus(-D(x')); the student's gradients equal the
reference's, and the critic's parameters get none (frozen critic: trunk and head).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dmd2_mega.config import OptimConfig
from dmd2_mega.methods.dmd2.actor import actor_phase
from dmd2_mega.methods.dmd2.critic import critic_phase
from dmd2_mega.methods.dmd2.gan import GANCritic, GANSettings
from dmd2_mega.flow import critic_grid
from tests.test_dmd2_actor import make_scores, reference as dmd_reference
from tests.test_dmd2_critic import (B, F64, G, M, RANGE, SHAPE, SHIFT, FakeRole, FakeTeacher, RecordingOptimizer,
                                    TinyNet, cycle_settings, gen_seed, make_rollouts, micro_batches, model_at,
                                    ref_fm_loss, ref_grid, rel_err)

pytestmark = pytest.mark.timeout(60)
W_D, W_G = 0.7, 0.9  # large weights, so a wrong GAN term shows well above round-off


class TinyTrunk(TinyNet):
    """TinyNet with the family interface's features (its hidden layer, one feature layer)."""

    spec, num_feature_layers, feature_dim = None, 1, 5

    def features(self, x, sigma, cond, layer):
        assert layer == 0
        return torch.tanh(x.reshape(x.shape[0], -1) @ self.w1 + self.table(cond) + sigma.to(F64)[:, None] * self.ws)


def tiny_gan(seed: int) -> GANCritic:
    model = GANCritic(TinyTrunk(seed), layer=0, seed=seed).double()
    with torch.no_grad():  # larger than the 0.02 init, so that the logits are O(1)
        for p in model.head.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7), dtype=F64))
    return model


def ref_logits(model, x, sigma, cond):
    """The head maths written out: W2 silu(W1 h + b1) + b2 on the hidden layer h."""
    t = model.trunk
    h = torch.tanh(x.reshape(x.shape[0], -1) @ t.w1 + t.table(cond) + sigma.to(F64)[:, None] * t.ws)
    l1, l2 = model.head.mlp[0], model.head.mlp[2]
    return (F.silu(h @ l1.weight.T + l1.bias) @ l2.weight.T + l2.bias).squeeze(-1)


def reals_for(k_steps: int) -> list:
    g = torch.Generator().manual_seed(77)
    return [torch.randn(k_steps * B, *SHAPE, generator=g, dtype=F64).clamp(-1, 1) for _ in range(M)]


def settings(noise: bool) -> GANSettings:
    grid, in_range = critic_grid(G, SHIFT, RANGE)
    return GANSettings(W_D, W_G, noise, grid[in_range])


@pytest.mark.parametrize("noise", [True, False], ids=["noised", "clean"])
def test_critic_steps_with_gan_equal_float64_replay(noise):
    k_steps = 2
    critic = tiny_gan(seed=1)
    opt = RecordingOptimizer(critic, OptimConfig(lr=0.05, clip_grad=1.0, weight_decay=0.01))
    rollouts, reals = make_rollouts(k_steps), reals_for(k_steps)
    _, metrics = critic_phase(FakeRole(critic, opt), FakeRole(FakeTeacher()), rollouts,
                              micro_batches(rollouts, reals=reals), cycle_settings(k_steps, gan=settings(noise)))
    full, mask = ref_grid()
    score = full[mask]
    rgens = [torch.Generator().manual_seed(gen_seed(j)) for j in range(M)]
    d_losses = []
    assert len(opt.records) == k_steps
    for k, (params, grads) in enumerate(opt.records):
        model = model_at(critic, params)
        total = torch.zeros((), dtype=F64)
        rows = slice(k * B, (k + 1) * B)
        for j, r in enumerate(rollouts):
            x0hat, cond = r.x0hat[rows], r.cond[rows]
            choices = score if k == k_steps - 1 else full
            idx = torch.randint(0, choices.numel(), (B,), generator=rgens[j])
            sigma, eps = choices[idx], torch.randn(x0hat.shape, generator=rgens[j], dtype=F64)
            s = sigma.to(F64).reshape(-1, 1, 1, 1)
            x_s = (1 - s) * x0hat + s * eps
            fm = ref_fm_loss(model(x_s, sigma, cond), x0hat, eps, sigma, x_s, "velocity").mean()
            both = torch.cat([x0hat, reals[j][rows]])
            if noise:
                idx = torch.randint(0, score.numel(), (2 * B,), generator=rgens[j])
                sg = score[idx]
                eg = torch.randn(both.shape, generator=rgens[j], dtype=F64)
                xg = (1 - sg.to(F64).reshape(-1, 1, 1, 1)) * both + sg.to(F64).reshape(-1, 1, 1, 1) * eg
            else:
                xg, sg = both, torch.zeros(2 * B)
            logits = ref_logits(model, xg, sg, torch.cat([cond, cond]))
            ld = F.softplus(logits[:B]).mean() + F.softplus(-logits[B:]).mean()
            d_losses.append(float(ld.detach()))
            total = total + (fm + W_D * ld) / M
        total.backward()
        for n, p in model.named_parameters():
            assert grads[n] is not None, n
            err = rel_err(grads[n], p.grad)
            assert err < 1e-6, f"step {k}: gradient of {n} differs from the replay (rel {err:.2e})"
        assert model.head.mlp[2].weight.grad.abs().max() > 1e-4  # the head really trains
    assert float(metrics["gan-disc-loss"]) == pytest.approx(sum(d_losses) / len(d_losses), rel=1e-6)


def test_actor_generator_loss_reaches_student_only():
    student, critic = TinyNet(seed=4), tiny_gan(seed=9)
    init, critic_before = copy.deepcopy(student), copy.deepcopy(critic)
    scores = make_scores(student)
    opt = RecordingOptimizer(student, OptimConfig(lr=0.01, clip_grad=100.0))
    batches = micro_batches(make_rollouts(1), actor_seeds=[300 + j for j in range(M)])
    metrics = actor_phase(FakeRole(student, opt), scores, settings(True), FakeRole(critic), batches)
    # reference: the DMD part by the actor test's replay, the GAN part written out here
    ref = copy.deepcopy(init)
    _, ref_metrics, _ = dmd_reference(ref, scores)
    score = settings(True).choices
    rgens = [torch.Generator().manual_seed(300 + j) for j in range(M)]
    g_total = torch.zeros((), dtype=F64)
    for j, sc in enumerate(scores):
        x0hat = sc.x - sc.sigma.to(F64).reshape(-1, 1, 1, 1) * ref(sc.x, sc.sigma, sc.cond)
        idx = torch.randint(0, score.numel(), (B,), generator=rgens[j])
        sg = score[idx]
        eg = torch.randn(x0hat.shape, generator=rgens[j], dtype=F64)
        s = sg.to(F64).reshape(-1, 1, 1, 1)
        g_total = g_total + F.softplus(-ref_logits(critic_before, (1 - s) * x0hat + s * eg, sg, sc.cond)).mean() / M
    (W_G * g_total).backward()  # accumulates onto the DMD gradients of dmd_reference
    params, grads = opt.records[0]
    for n, p in ref.named_parameters():
        err = rel_err(grads[n], p.grad)
        assert err < 1e-6, f"student gradient of {n} differs (rel {err:.2e})"  # fp32 (1 - sigma)
    assert float(metrics["actor-gan-loss"]) == pytest.approx(float(g_total), rel=1e-6)
    assert float(metrics["actor-dmd-loss"]) == pytest.approx(ref_metrics["actor-dmd-loss"], rel=1e-9)
    for n, p in critic.named_parameters():  # frozen: no gradient, weights untouched
        assert p.grad is None, f"critic parameter {n} received a gradient in the actor phase"
        assert torch.equal(p, dict(critic_before.named_parameters())[n])
    # the GAN term really changes the update: without it the gradient differs
    ref2 = copy.deepcopy(init)
    dmd_only, _, _ = dmd_reference(ref2, make_scores(copy.deepcopy(init)))
    assert max(rel_err(grads[n], dmd_only[n]) for n in dmd_only) > 1e-3
