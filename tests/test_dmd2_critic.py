"""Critic phase (dmd2_mega/methods/dmd2/critic.py) against a float64 replay written here from DESIGN section 2.

Setup: M = 2 micro-batches per rank, B = 3, K critic steps, images [B, 2, 3, 3] float64; a tiny
float64 critic (TinyNet) trained by dmd2_mega.train.optim.Optimizer; a fake teacher with a closed-form
velocity v_T(x, sigma, c) = -0.5 x + 0.3 sigma + mu[c] (mu[null] its own mean, so CFG matters).
Critic grid: G = 20 points s_g = (G - g) / G (unshifted), shift k = 3; score range 0.3 0.6 on the
UNSHIFTED value, asymmetric on purpose: its shifted images lie in [0.5625, 0.818], so testing the
range on the shifted sigma, or taking the range symmetric, picks other points.

Replay of micro-batch j (its own generator, the documented order), step k on rows [kB, (k+1)B):
    original, last step only, first: idx ~ randint(#score choices), eps ~ randn(x0hat.shape)
    idx ~ randint(#choices) with choices = score-range points on the last step (shared), else all G;
    eps ~ randn(x0hat.shape);   x_s = (1 - sigma) x0hat + sigma eps
    velocity: loss_n = mean((v - (eps - x0hat))^2);  x0: loss_n = mean(((x_s - sigma v) - x0hat)^2)
The optimizer of the fake role records the critic's parameters and gradients before each step;
step k's gradients must equal autograd of (1/M) sum_j mean_n loss_n at the recorded parameters.
Scores (last step only): x0_fake = x_s - sigma v_C(x_s) with the critic BEFORE the last step,
x0_real = x_s - sigma (v_neg + g (v_pos - v_neg)) from the closed form.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import pytest
import torch

from dmd2_mega.config import OptimConfig
from dmd2_mega.methods.dmd2.critic import critic_phase
from dmd2_mega.methods.base import MicroBatch
from dmd2_mega.methods.dmd2.records import DMD2Settings, Scores
from dmd2_mega.methods.rollout import Rollout
from dmd2_mega.flow import critic_grid
from dmd2_mega.train.optim import Optimizer

pytestmark = pytest.mark.timeout(60)

SHAPE = (2, 3, 3)  # odd sizes on purpose
CLASSES = 4        # null class id = 4
B, M, G, SHIFT = 3, 2, 20, 3.0
RANGE = (0.3, 0.6)
F64 = torch.float64


class TinyNet(torch.nn.Module):
    """v(x, sigma, c) = W2 tanh(W1 x + table[c] + sigma w_s) + b2, float64; records every call."""

    def __init__(self, seed: int = 0, hidden: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        d = SHAPE[0] * SHAPE[1] * SHAPE[2]
        self.w1 = torch.nn.Parameter(0.4 * torch.randn(d, hidden, generator=g, dtype=F64))
        self.table = torch.nn.Embedding(CLASSES + 1, hidden, dtype=F64)
        with torch.no_grad():
            self.table.weight.copy_(0.5 * torch.randn(CLASSES + 1, hidden, generator=g, dtype=F64))
        self.ws = torch.nn.Parameter(torch.randn(hidden, generator=g, dtype=F64))
        self.w2 = torch.nn.Parameter(0.4 * torch.randn(hidden, d, generator=g, dtype=F64))
        self.b2 = torch.nn.Parameter(0.1 * torch.randn(d, generator=g, dtype=F64))
        self.calls: list = []

    def forward(self, x, sigma, cond):
        self.calls.append({"n": x.shape[0], "cond": cond.clone(), "grad": torch.is_grad_enabled()})
        h = torch.tanh(x.reshape(x.shape[0], -1) @ self.w1 + self.table(cond) + sigma.to(F64)[:, None] * self.ws)
        return (h @ self.w2 + self.b2).reshape(x.shape)

    def pin_given(self, x0, cond):  # the FamilyModel contract's default: a class condition fixes nothing
        return x0


MU = torch.randn(CLASSES + 1, *SHAPE, generator=torch.Generator().manual_seed(99), dtype=F64)


def teacher_v(x, sigma, cond):
    """The closed form of FakeTeacher, written separately for the reference."""
    return -0.5 * x + 0.3 * sigma.to(F64).reshape(-1, 1, 1, 1) + MU[cond]


class FakeTeacher(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls: list = []

    def forward(self, x, sigma, cond):
        self.calls.append({"n": x.shape[0], "cond": cond.clone(), "grad": torch.is_grad_enabled()})
        s = sigma.to(F64)
        return -0.5 * x + 0.3 * s[:, None, None, None] + MU.index_select(0, cond)

    def null_cond(self, n, device):
        return null_cond(n, device)

    def negative_for(self, cond):  # the FamilyModel contract's default
        return null_cond(cond.shape[0], cond.device)

    def pin_given(self, x0, cond):
        return x0


class RecordingOptimizer:
    """dmd2_mega.train.optim.Optimizer that records (parameters, gradients) just before each step."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        self.model, self.inner, self.records = model, Optimizer(model, cfg), []

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.records.append((params, grads))
        return self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


@dataclass
class FakeRole:
    model: torch.nn.Module
    optimizer: Optional[RecordingOptimizer] = None

    def accumulating(self, last: bool):
        return contextlib.nullcontext()


def null_cond(n, device):
    return torch.full((n,), CLASSES, dtype=torch.int64, device=device)


def cycle_settings(k_steps: int, scoring: str = "shared", space: str = "velocity", guidance: float = 1.0,
                   gan=None) -> DMD2Settings:
    """The settings record of these tests: grid G, shift 3, score range RANGE, micro-batch B."""
    grid, in_range = critic_grid(G, SHIFT, RANGE)
    return DMD2Settings(critic_steps=k_steps, micro_batch_size=B, shape=SHAPE, device=torch.device("cpu"),
                         student_sigmas=torch.ones(1), critic_grid=grid, score_choices=grid[in_range],
                         scoring=scoring, loss_space=space, guidance=guidance, gan=gan)


def micro_batches(rollouts: list[Rollout], reals=None, actor_seeds=None) -> list[MicroBatch]:
    """Records whose critic generator j is seeded gen_seed(j) (what the replays draw from)."""
    return [MicroBatch(index=j, cond=r.cond, sample_id_offset=int(r.sample_id[0]), rollout_gen=torch.Generator(),
                       critic_gen=torch.Generator().manual_seed(gen_seed(j)),
                       actor_gen=None if actor_seeds is None else torch.Generator().manual_seed(actor_seeds[j]),
                       real=None if reals is None else reals[j]) for j, r in enumerate(rollouts)]


def make_rollouts(k_steps: int, seed: int = 3) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(M):
        n = k_steps * B
        out.append(Rollout(x=torch.randn(n, *SHAPE, generator=g, dtype=F64),
                           sigma=torch.rand(n, generator=g).float(),
                           x0hat=torch.randn(n, *SHAPE, generator=g, dtype=F64).clamp(-1, 1),
                           cond=torch.randint(0, CLASSES, (n,), generator=g),
                           sample_id=torch.arange(n) + 1000 * j, stop_step=torch.randint(0, 4, (n,), generator=g)))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the sigmas are float32, so x_s = (1 - sigma) x0hat + sigma eps carries
    float32 round-off of (1 - sigma) (~1e-8 relative) however it is written; a wrong draw is O(1)."""
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def gen_seed(j: int) -> int:
    return 500 + 17 * j


# ---- the independent grid -------------------------------------------------------------------

def ref_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """(all shifted sigmas [G] as float32, in-range mask on the unshifted value), by exact fractions."""
    fr = [Fraction(G - g, G) for g in range(G)]
    lo, hi = Fraction(str(RANGE[0])), Fraction(str(RANGE[1]))
    mask = torch.tensor([lo <= s <= hi for s in fr])
    shifted = torch.tensor([float(SHIFT * s / (SHIFT * s + 1 - s)) for s in fr], dtype=F64).float()
    return shifted, mask


def unshift(sigma: torch.Tensor) -> torch.Tensor:
    s = sigma.to(F64)
    return s / (SHIFT - (SHIFT - 1) * s)


def test_critic_grid_uses_unshifted_asymmetric_range():
    grid, in_range = critic_grid(G, SHIFT, RANGE)
    want_grid, want_mask = ref_grid()
    assert grid.dtype == torch.float32 and grid.shape == (G,)
    torch.testing.assert_close(grid, want_grid, rtol=1e-7, atol=0)
    assert torch.equal(in_range, want_mask), (in_range, want_mask)
    assert int(want_mask.sum()) == 7  # s = 0.6, 0.55, ..., 0.3: both ends inclusive
    chosen = grid[in_range]
    u = unshift(chosen)
    assert bool(((u >= RANGE[0] - 1e-6) & (u <= RANGE[1] + 1e-6)).all())
    # teeth: the shifted values of the chosen points are NOT in [MIN, MAX], and the points whose
    # shifted value is in [MIN, MAX] are others (what a range on the shifted sigma would pick)
    assert float(chosen.min()) > RANGE[1] - 0.05
    assert not torch.equal((grid >= RANGE[0]) & (grid <= RANGE[1]), in_range)


# ---- replay ---------------------------------------------------------------------------------

def replay_draws(rollouts, k_steps: int, scoring: str):
    """Per step k, per micro j: (x0hat, cond, sigma, eps, x_s) of the training batch; and per j the
    scored (b, x_s, sigma) of the last step (shared: the training draw; original: the separate one)."""
    full, mask = ref_grid()
    score_choices = full[mask]
    gens = [torch.Generator().manual_seed(gen_seed(j)) for j in range(M)]

    def draw(j, x0hat, choices):
        idx = torch.randint(0, choices.numel(), (x0hat.shape[0],), generator=gens[j])
        sigma = choices[idx]
        eps = torch.randn(x0hat.shape, generator=gens[j], dtype=x0hat.dtype)
        s = sigma.to(F64).reshape(-1, 1, 1, 1)
        return sigma, eps, (1 - s) * x0hat + s * eps

    steps, scored = [], [None] * M
    for k in range(k_steps):
        last = k == k_steps - 1
        rows = slice(k * B, (k + 1) * B)
        if last and scoring == "original":
            for j, r in enumerate(rollouts):
                sigma, _, x_s = draw(j, r.x0hat[rows], score_choices)
                scored[j] = (rows, x_s, sigma)
        batch = []
        for j, r in enumerate(rollouts):
            choices = score_choices if last and scoring == "shared" else full
            sigma, eps, x_s = draw(j, r.x0hat[rows], choices)
            batch.append((r.x0hat[rows], r.cond[rows], sigma, eps, x_s))
            if last and scoring == "shared":
                scored[j] = (rows, x_s, sigma)
        steps.append(batch)
    return steps, scored


def ref_fm_loss(v, x0hat, eps, sigma, x_s, space: str) -> torch.Tensor:
    """Per-sample flow-matching loss [B], float64, as the maths reads."""
    if space == "velocity":
        return ((v - (eps - x0hat)) ** 2).flatten(1).mean(1)
    s = sigma.to(F64).reshape(-1, 1, 1, 1)
    return (((x_s - s * v) - x0hat) ** 2).flatten(1).mean(1)


def model_at(template: torch.nn.Module, params: dict) -> torch.nn.Module:
    m = copy.deepcopy(template)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(params[n])
    m.calls = []
    return m


def run_phase(k_steps, scoring, space, guidance):
    critic = TinyNet(seed=1)
    init = copy.deepcopy(critic)
    opt = RecordingOptimizer(critic, OptimConfig(lr=0.05, clip_grad=1.0, weight_decay=0.01))
    teacher = FakeTeacher()
    rollouts = make_rollouts(k_steps)
    scores, metrics = critic_phase(FakeRole(critic, opt), FakeRole(teacher), rollouts, micro_batches(rollouts),
                                   cycle_settings(k_steps, scoring, space, guidance))
    return dict(critic=critic, init=init, opt=opt, teacher=teacher, rollouts=rollouts, scores=scores,
                metrics=metrics)


CASES = [(k, scoring, space, g) for k in (3, 1) for scoring in ("shared", "original")
         for space in ("velocity", "x0") for g in (1.0, 2.5)]
IDS = [f"K{k}-{s}-{sp}-g{g}" for k, s, sp, g in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def phase(request):
    k_steps, scoring, space, guidance = request.param
    out = run_phase(k_steps, scoring, space, guidance)
    steps, scored = replay_draws(out["rollouts"], k_steps, scoring)
    out.update(k=k_steps, scoring=scoring, space=space, guidance=guidance, steps=steps, scored=scored)
    return out


def test_each_step_trains_on_the_flow_matching_batch(phase):
    """Step k's gradients = autograd of the replayed flow-matching loss at the recorded parameters."""
    records = phase["opt"].records
    assert len(records) == phase["k"], "one critic optimizer step per k"
    for n, p in phase["init"].named_parameters():  # the first step starts from the initial critic
        assert torch.equal(records[0][0][n], p.detach()), n
    step_losses = []
    for k, (params, grads) in enumerate(records):
        ref = model_at(phase["init"], params)
        total = torch.zeros((), dtype=F64)
        for x0hat, cond, sigma, eps, x_s in phase["steps"][k]:
            v = ref(x_s, sigma, cond)
            total = total + ref_fm_loss(v, x0hat, eps, sigma, x_s, phase["space"]).mean() / M
        total.backward()
        step_losses.append(float(total.detach()))
        for n, p in ref.named_parameters():
            assert grads[n].dtype == F64
            assert rel_err(grads[n], p.grad) <= 1e-6, f"step {k}: grad of {n}: rel {rel_err(grads[n], p.grad):.2e}"
    want = sum(step_losses) / len(step_losses)
    got = float(phase["metrics"]["critic-loss"])
    assert abs(got - want) <= 1e-6 * abs(want), f"critic-loss {got} vs replayed {want}"
    last_grads = torch.cat([g.flatten() for g in records[-1][1].values()])
    assert abs(float(phase["metrics"]["critic-grad_norm"]) - float(last_grads.norm())) <= 1e-5 * float(last_grads.norm())


def test_last_step_sigma_in_unshifted_score_range(phase):
    """The last step's sigmas (replayed; the gradient test proves the code drew the same) are grid
    points with unshifted value in [0.3, 0.6]; the other steps use the full grid."""
    full, mask = ref_grid()
    last = torch.cat([b[2] for b in phase["steps"][-1]])
    scored = torch.cat([s[2] for s in phase["scored"]])
    for sig in ([scored] if phase["scoring"] == "original" else [last, scored]):
        u = unshift(sig)
        assert bool(((u >= RANGE[0] - 1e-6) & (u <= RANGE[1] + 1e-6)).all()), u
        assert all(bool((full[mask] == s).any()) for s in sig)
    if phase["k"] > 1:  # a full-grid step draws outside the range too (6 draws of 20 points)
        earlier = torch.cat([b[2] for step in phase["steps"][:-1] for b in step])
        assert bool(((unshift(earlier) < RANGE[0] - 1e-6) | (unshift(earlier) > RANGE[1] + 1e-6)).any())


def test_x0_space_is_sigma_squared_velocity_mse(phase):
    for x0hat, cond, sigma, eps, x_s in phase["steps"][0]:
        v = torch.randn(x_s.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        a = ref_fm_loss(v, x0hat, eps, sigma, x_s, "x0")
        b = sigma.to(F64) ** 2 * ref_fm_loss(v, x0hat, eps, sigma, x_s, "velocity")
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


def test_only_last_step_samples_are_scored(phase):
    scores, rollouts, k = phase["scores"], phase["rollouts"], phase["k"]
    assert len(scores) == M and all(isinstance(s, Scores) for s in scores)
    rows = slice((k - 1) * B, k * B)
    for s, r in zip(scores, rollouts):
        assert torch.equal(s.sample_id, r.sample_id[rows])
        assert torch.equal(s.x, r.x[rows]) and torch.equal(s.sigma, r.sigma[rows]) and torch.equal(s.cond, r.cond[rows])
        assert s.x0_fake.shape == s.x0_real.shape == (B, *SHAPE)
        assert not s.x0_fake.requires_grad and not s.x0_real.requires_grad


def test_scores_equal_separate_critic_and_teacher_forwards(phase):
    """x0_fake: the critic before the last optimizer step at the kept (x_s, sigma), positive cond;
    x0_real: the closed-form teacher with CFG g over the null condition."""
    records, g = phase["opt"].records, phase["guidance"]
    before_last = model_at(phase["init"], records[-1][0])
    after_last = model_at(phase["init"], {n: p.detach() for n, p in phase["critic"].named_parameters()})
    for j, (s, (rows, x_s, sigma)) in enumerate(zip(phase["scores"], phase["scored"])):
        cond = phase["rollouts"][j].cond[rows]
        sg = sigma.to(F64).reshape(-1, 1, 1, 1)
        with torch.no_grad():
            fake = x_s - sg * before_last(x_s, sigma, cond)
            stale = x_s - sg * after_last(x_s, sigma, cond)
        v_pos, v_neg = teacher_v(x_s, sigma, cond), teacher_v(x_s, sigma, null_cond(B, "cpu"))
        real = x_s - sg * (v_neg + g * (v_pos - v_neg))
        assert rel_err(s.x0_fake, fake) <= 1e-6, f"x0_fake micro {j}: rel {rel_err(s.x0_fake, fake):.2e}"
        assert rel_err(s.x0_real, real) <= 1e-6, f"x0_real micro {j}: rel {rel_err(s.x0_real, real):.2e}"
        # teeth: the critic after the last step (the state trained on these samples) scores differently
        assert float((stale - fake).abs().max()) > 1e-4
        if g != 1.0:  # and guidance changes the teacher's x0
            assert float((real - (x_s - sg * v_pos)).abs().max()) > 1e-3


def test_teacher_runs_once_per_micro_batch_no_grad(phase):
    calls, g = phase["teacher"].calls, phase["guidance"]
    assert len(calls) == M, calls
    for j, c in enumerate(calls):
        cond = phase["rollouts"][j].cond[(phase["k"] - 1) * B: phase["k"] * B]
        assert not c["grad"]
        if g == 1.0:  # positive condition only, batch B
            assert c["n"] == B and torch.equal(c["cond"], cond)
        else:         # one forward of both conditions, batch 2B
            assert c["n"] == 2 * B and torch.equal(c["cond"], torch.cat([cond, null_cond(B, "cpu")]))


def test_critic_forward_order_and_unguided(phase):
    """Critic calls: M training forwards per step; `original` adds M no-grad forwards right before the
    last step's training forwards; every critic forward uses the positive condition only."""
    calls, k = phase["critic"].calls, phase["k"]
    want = [True] * (M * (k - 1)) + ([False] * M if phase["scoring"] == "original" else []) + [True] * M
    assert [c["grad"] for c in calls] == want
    assert all(c["n"] == B and int(c["cond"].max()) < CLASSES for c in calls)
