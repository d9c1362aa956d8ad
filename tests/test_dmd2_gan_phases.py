"""The GAN head inside the critic and actor phases, against float64 replays written here.

Critic with a head: the package's GANCritic (layer 0) around TinyTrunk = TinyNet plus
features(x, sigma, c, 0) = its hidden layer h = tanh(W1 x + table[c] + sigma w_s) [B, 5], in float64;
forward(x, sigma, c, extra=(x', sigma', c')) returns (v, head(features(x)), head(features(x'))).
Critic step k, micro j (generator of j): idx, eps of the flow-matching step, x_s at sigma, then
    fakes: x_s itself, counted where sigma is a point of the GAN range (a range wider than the score range, so that
        the first step's full-grid draws fall both in and out of it);
    reals: rows [kB, kB + r) of the micro-batch's samples, idx' ~ randint(#GAN choices, r), eps' ~ randn(r, ...):
        x' = (1 - s') real + s' eps'   (--no-dmd2-gan-noise: fakes x0hat and reals at s' = 0, nothing drawn)
    L = mean_n fm_n + w_D (mean over counted fakes of softplus(D(fake)) + mean softplus(-D(x'_real)))
    (the unweighted head's maths on the counted rows: a step with none counted has the real term only)
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
from dmd2_mega.methods.dmd2.gan import GANCritic, GANSettings, HeadOptions
from dmd2_mega.flow import critic_grid
from dmd2_mega.models import FamilyModel
from tests.test_dmd2_actor import make_scores, reference as dmd_reference
from tests.test_dmd2_critic import (B, F64, G, M, RANGE, SHAPE, SHIFT, FakeRole, FakeTeacher, RecordingOptimizer,
                                    TinyNet, cycle_settings, gen_seed, make_rollouts, micro_batches, model_at,
                                    ref_fm_loss, ref_grid, rel_err)

pytestmark = pytest.mark.timeout(60)
W_D, W_G = 0.7, 0.9  # large weights, so a wrong GAN term shows well above round-off


class TinyTrunk(TinyNet):
    """TinyNet with the family interface's features (its hidden layer as a 1 x 1 grid, one feature layer)."""

    spec, num_feature_layers, feature_dim, feature_grid = None, 1, 5, (1, 1)

    def features(self, x, sigma, cond, layer):
        assert layer == 0
        h = torch.tanh(x.reshape(x.shape[0], -1) @ self.w1 + self.table(cond) + sigma.to(F64)[:, None] * self.ws)
        return h[:, :, None, None]

    def forward_features(self, x, sigma, cond, layer):
        return self(x, sigma, cond), self.features(x, sigma, cond, layer)

    forward_features_and = FamilyModel.forward_features_and  # the contract's default: forward_features, features


def tiny_gan(seed: int) -> GANCritic:
    model = GANCritic(TinyTrunk(seed), layer=0, seed=seed, head=HeadOptions("mlp")).double()  # closed form below
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


GAN_RANGE = (0.2, 0.75)  # wider than the score range RANGE: the first step's draws fall in and out of it
R = 2  # real samples per critic step, fewer than B


def settings(noise: bool, sigma_range: tuple = RANGE, fakes: str = "own") -> GANSettings:
    grid, in_range = critic_grid(G, SHIFT, sigma_range)
    return GANSettings(W_D, W_G, noise, grid[in_range], real_rows=R, fakes=fakes)


@pytest.mark.parametrize("noise,fakes", [(True, "own"), (True, "separate"), (False, "own")],
                         ids=["noised", "noised-separate", "clean"])
def test_critic_steps_with_gan_equal_float64_replay(noise, fakes):
    k_steps = 2
    critic = tiny_gan(seed=1)
    opt = RecordingOptimizer(critic, OptimConfig(lr=0.05, clip_grad=1.0, weight_decay=0.01))
    rollouts, reals = make_rollouts(k_steps), reals_for(k_steps)
    gan = settings(noise, GAN_RANGE, fakes)
    _, metrics = critic_phase(FakeRole(critic, opt), FakeRole(FakeTeacher()), rollouts,
                              micro_batches(rollouts, reals=reals), cycle_settings(k_steps, gan=gan))
    full, mask = ref_grid()
    score = full[mask]
    gan_choices = critic_grid(G, SHIFT, GAN_RANGE)[0][critic_grid(G, SHIFT, GAN_RANGE)[1]]
    rgens = [torch.Generator().manual_seed(gen_seed(j)) for j in range(M)]
    d_losses, counted = [], []
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
            real = reals[j][k * B:k * B + R]
            if noise:  # the fakes: the step's own inputs, those at a GAN-range sigma
                keep = torch.tensor([float(v) in gan_choices.tolist() for v in sigma])
                fake = ref_logits(model, x_s, sigma, cond)[keep]
                idx = torch.randint(0, gan_choices.numel(), (R,), generator=rgens[j])
                sg = gan_choices[idx]
                eg = torch.randn(real.shape, generator=rgens[j], dtype=F64)
                xr = (1 - sg.to(F64).reshape(-1, 1, 1, 1)) * real + sg.to(F64).reshape(-1, 1, 1, 1) * eg
                if fakes == "separate":  # the first R rows' x0hat noised apart into the range, drawn after the reals
                    sf = gan_choices[torch.randint(0, gan_choices.numel(), (R,), generator=rgens[j])]
                    ef = torch.randn(x0hat[:R].shape, generator=rgens[j], dtype=F64)
                    xf = (1 - sf.to(F64).reshape(-1, 1, 1, 1)) * x0hat[:R] + sf.to(F64).reshape(-1, 1, 1, 1) * ef
                    keep = torch.ones(R, dtype=torch.bool)
                    fake = ref_logits(model, xf, sf, cond[:R])
            else:
                keep = torch.ones(B, dtype=torch.bool)
                fake = ref_logits(model, x0hat, torch.zeros(B), cond)
                xr, sg = real, torch.zeros(R)
            counted.append(int(keep.sum()))
            fake_term = F.softplus(fake).mean() if keep.any() else torch.zeros((), dtype=F64)
            ld = fake_term + F.softplus(-ref_logits(model, xr, sg, cond[:R])).mean()
            d_losses.append(float(ld.detach()))
            total = total + (fm + W_D * ld) / M
        total.backward()
        for n, p in model.named_parameters():
            assert grads[n] is not None, n
            err = rel_err(grads[n], p.grad)
            assert err < 1e-6, f"step {k}: gradient of {n} differs from the replay (rel {err:.2e})"
        assert model.head.mlp[2].weight.grad.abs().max() > 1e-4  # the head really trains
    assert float(metrics["gan-disc-loss"]) == pytest.approx(sum(d_losses) / len(d_losses), rel=1e-6)
    assert float(metrics["gan-fake-share"]) == pytest.approx(sum(counted) / (len(counted) * B), rel=1e-6)
    if noise and fakes == "own":  # the masking is exercised: the first step counted some rows and left out others
        assert 0 < sum(counted[:M]) < M * B, counted


def test_critic_step_with_gan_reads_one_forward_per_fake_row():
    """Riding on the critic's forward: each critic step runs the trunk's forward_features on the B fakes and a
    features-only forward on the R reals, nothing else (the clean form adds a forward on the B fakes)."""
    calls = []

    class Counting(TinyTrunk):
        def forward_features(self, x, sigma, cond, layer):
            calls.append(("both", x.shape[0]))
            return self(x, sigma, cond), TinyTrunk.features(self, x, sigma, cond, layer)

        def features(self, x, sigma, cond, layer):
            calls.append(("features", x.shape[0]))
            return super().features(x, sigma, cond, layer)

    for noise, want in ((True, [("both", B), ("features", R)]), (False, [("both", B), ("features", B + R)])):
        critic = GANCritic(Counting(1), layer=0, seed=1).double()
        opt = RecordingOptimizer(critic, OptimConfig(lr=0.05, clip_grad=1.0))
        rollouts = make_rollouts(1)
        calls.clear()
        critic_phase(FakeRole(critic, opt), FakeRole(FakeTeacher()), rollouts,
                     micro_batches(rollouts, reals=reals_for(1)), cycle_settings(1, gan=settings(noise)))
        assert calls == want * M, (noise, calls)


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


def test_real_rows_default_to_b_and_more_than_b_is_refused():
    """--dmd2-gan-real-rows (issue 54 item 2): B by default, each of a micro-batch's K x B samples once per cycle; more
    than B would reuse the next critic step's rows, one clear error; below 1 refused at parse."""
    from dmd2_mega.arguments import parse_dmd2_args
    from dmd2_mega.errors import ConfigError
    from dmd2_mega.flow import critic_grid
    from dmd2_mega.methods.dmd2.gan import gan_part
    base = ["--teacher-load", "x", "--micro-batch-size", "3", "--dmd2-critic-steps-per-rollout", "4", "--dmd2-gan"]
    grid = critic_grid(1000, 3.0, (0.02, 0.98))[0]
    assert gan_part(parse_dmd2_args(base), grid).real_rows == 3
    assert gan_part(parse_dmd2_args(base + ["--dmd2-gan-real-rows", "2"]), grid).real_rows == 2
    with pytest.raises(ConfigError, match="--dmd2-gan-real-rows 4: at most --micro-batch-size 3"):
        gan_part(parse_dmd2_args(base + ["--dmd2-gan-real-rows", "4"]), grid)
    with pytest.raises(ConfigError, match="--dmd2-gan-real-rows must be >= 1"):
        parse_dmd2_args(base + ["--dmd2-gan-real-rows", "0"])
