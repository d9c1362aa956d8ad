"""Actor phase (dmd2_mega/methods/dmd2/actor.py) against autograd through the plain-torch DMD formula in float64.

Reference, for each scored micro-batch j of M (x, sigma [B] fp32, cond, x0_real, x0_fake given):
    x0hat  = x - sigma v_S(x, sigma, cond)                               WITH grad (float64 student)
    norm_n = mean_{sample n} |x0hat - x0_real|                           (no grad)
    grad   = nan_to_num((x0_fake - x0_real) / norm_n)                    (no grad)
    loss_j = 0.5 * mse(x0hat, (x0hat - grad).detach());   total = (1/M) sum_j loss_j;   backward
The student's gradients, recorded just before the optimizer step by the fake role's optimizer,
must equal the reference's; the update must be one AdamW step (first step, bias-corrected) on
the clipped gradient: g' = g min(1, clip / (||g|| + 1e-6)); decoupled weight decay on matrices
only (not on 1-D parameters nor on the `table.weight` embedding);
    p <- p (1 - lr wd) - lr g' / (|g'| + eps)      (m_hat = g', sqrt(v_hat) = |g'| at step 1).
One sample of micro-batch 0 has x0_fake = x0_real = its own x0hat (bit-exact): norm 0, 0/0 -> grad 0.
Shapes: x, x0_real, x0_fake [B, 2, 3, 3] float64; B = 3, M = 2.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dmd2_kernels

from dmd2_mega.config import OptimConfig
from dmd2_mega.methods.dmd2.actor import actor_phase
from dmd2_mega.methods.dmd2.records import Scores
from tests.test_dmd2_critic import F64, SHAPE, CLASSES, FakeRole, RecordingOptimizer, TinyNet, rel_err

pytestmark = pytest.mark.timeout(60)

B, M = 3, 2
LR, WD, BETAS, EPS, CLIP = 0.01, 0.1, (0.5, 0.9), 5e-4, 0.01


def make_scores(student: torch.nn.Module) -> list[Scores]:
    g = torch.Generator().manual_seed(21)
    out = []
    for j in range(M):
        x = torch.randn(B, *SHAPE, generator=g, dtype=F64)
        sigma = torch.rand(B, generator=g).float() * 0.9 + 0.05
        cond = torch.randint(0, CLASSES, (B,), generator=g)
        x0_real = torch.randn(B, *SHAPE, generator=g, dtype=F64).clamp(-1, 1)
        x0_fake = x0_real + 0.3 * torch.randn(B, *SHAPE, generator=g, dtype=F64)
        if j == 0:  # sample 1: x0_fake = x0_real = x0hat -> 0 / 0 (built with the kernel the actor
            with torch.no_grad():  # uses, so that it is bit-identical to the actor's x0hat)
                x0hat = dmd2_kernels.x0_from_velocity(x, student(x, sigma, cond), sigma)
            x0_real[1] = x0hat[1]
            x0_fake[1] = x0hat[1]
        out.append(Scores(sample_id=torch.arange(B) + 10 * j, x=x, sigma=sigma, cond=cond,
                          x0_fake=x0_fake, x0_real=x0_real))
    student.calls = []
    return out


def reference(student: torch.nn.Module, scores: list[Scores]):
    total, norms, gaps, rms = torch.zeros((), dtype=F64), [], [], []
    for sc in scores:
        x0hat = sc.x - sc.sigma.to(F64).reshape(-1, 1, 1, 1) * student(sc.x, sc.sigma, sc.cond)
        with torch.no_grad():
            norm = (x0hat - sc.x0_real).abs().flatten(1).mean(1)
            grad = torch.nan_to_num((sc.x0_fake - sc.x0_real) / norm.reshape(-1, 1, 1, 1))
        loss = 0.5 * F.mse_loss(x0hat, (x0hat - grad).detach())
        total = total + loss / len(scores)
        norms.append(norm.mean())
        gaps.append((sc.x0_fake - sc.x0_real).abs().mean())
        rms.append(grad.square().mean().sqrt())
    total.backward()
    metrics = {"actor-dmd-loss": float(total.detach()), "dmd-normaliser": float(torch.stack(norms).mean()),
               "dmd-fake-real-gap": float(torch.stack(gaps).mean()), "dmd-grad-rms": float(torch.stack(rms).mean())}
    return {n: p.grad.clone() for n, p in student.named_parameters()}, metrics, norms


@pytest.fixture(scope="module")
def actor():
    student = TinyNet(seed=4)
    init = copy.deepcopy(student)
    scores = make_scores(student)
    opt = RecordingOptimizer(student, OptimConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                                                  adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=CLIP))
    metrics = actor_phase(FakeRole(student, opt), scores)
    ref_model = copy.deepcopy(init)
    ref_grads, ref_metrics, ref_norms = reference(ref_model, scores)
    return dict(student=student, init=init, opt=opt, scores=scores, metrics=metrics, ref_grads=ref_grads,
                ref_metrics=ref_metrics, ref_norms=ref_norms)


def test_reference_exercises_nan_to_num(actor):
    """The hand-built sample really has norm 0 (so the code must map 0/0 to 0, not NaN)."""
    x0_real = actor["scores"][0].x0_real
    assert torch.equal(x0_real[1], actor["scores"][0].x0_fake[1])
    sc = actor["scores"][0]
    with torch.no_grad():
        x0hat = dmd2_kernels.x0_from_velocity(sc.x, actor["init"](sc.x, sc.sigma, sc.cond), sc.sigma)
    assert float((x0hat[1] - x0_real[1]).abs().max()) == 0.0


def test_student_grads_equal_float64_dmd_autograd(actor):
    params, grads = actor["opt"].records[0]
    assert len(actor["opt"].records) == 1, "one actor optimizer step per cycle"
    for n, p in actor["init"].named_parameters():
        assert torch.equal(params[n], p.detach()), f"{n}: the step must start from the initial student"
    for n, g in actor["ref_grads"].items():
        assert grads[n].dtype == F64 and bool(torch.isfinite(grads[n]).all()), n
        assert float(g.abs().max()) > 0, f"reference grad of {n} is zero: the test would be blind"
        assert rel_err(grads[n], g) <= 1e-9, f"grad of {n}: rel {rel_err(grads[n], g):.2e}"


def test_metrics_equal_reference(actor):
    m, ref = actor["metrics"], actor["ref_metrics"]
    for k, want in ref.items():
        got = float(m[k])
        assert abs(got - want) <= 1e-6 * abs(want), f"{k}: {got} vs {want}"
    gnorm = float(torch.cat([g.flatten() for g in actor["ref_grads"].values()]).norm())
    assert abs(float(m["actor-grad_norm"]) - gnorm) <= 1e-5 * gnorm


def test_student_calls_are_with_grad_on_the_scored_inputs(actor):
    calls = actor["student"].calls
    assert [c["n"] for c in calls] == [B] * M and all(c["grad"] for c in calls)
    for c, sc in zip(calls, actor["scores"]):
        assert torch.equal(c["cond"], sc.cond)


def test_update_is_one_clipped_adamw_step(actor):
    grads = actor["ref_grads"]
    gnorm = float(torch.cat([g.flatten() for g in grads.values()]).norm())
    assert gnorm > CLIP * 2, f"grad norm {gnorm} should exceed --clip-grad {CLIP} so clipping is tested"
    coef = min(1.0, CLIP / (gnorm + 1e-6))
    moved = 0.0
    for (n, p0), p1 in zip(actor["init"].named_parameters(), actor["student"].parameters()):
        g = grads[n] * coef
        wd = WD if p0.ndim >= 2 and not n.endswith("table.weight") else 0.0
        want = p0.detach() * (1 - LR * wd) - LR * g / (g.abs() + EPS)
        # the Optimizer steps fp32 master weights (the float64 student is treated as low precision)
        err = float((p1.detach() - want).abs().max())
        assert err <= 1e-6, f"{n}: AdamW update differs by {err:.2e}"
        moved = max(moved, float((p1.detach() - p0.detach()).abs().max()))
    assert moved > 0.5 * LR
