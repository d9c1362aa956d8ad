"""The method slot: a second method, written here in the test, runs through the shared student trainer
(`methods.trainer.StudentTrainer`) without a line of `methods/dmd2/`.

The toy method regresses a one-step student onto the frozen teacher's 4-step Euler sampler:
    phase "teacher"  (teacher resident, no step)   x_T ~ N(0, I) from the ROLLOUT stream;  y = Euler_4(teacher, x_T, cond)
    phase "regress"  (student resident, trains it)  x0hat = x_T - 1 * v_student(x_T, 1, cond);  loss = mean((x0hat - y)^2)
Its table names two roles, so the trainer builds no critic, saves the student alone in --save and resumes it; the
loop, the roles, time-slicing (--offload-inactive), the EMA, the log and the checkpoint are the shared ones.
Checked: the phases run in the table's order with the roles it names resident, the student learns (the loss of
a fixed batch falls) and the teacher does not move, the checkpoint holds the student (no <save>_critic), a resume
continues at the saved cycle with the saved weights, and DMD2's own tests are untouched by this file.
"""
import os

import pytest
import torch

from dmd2_mega import flow
from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.methods.base import CycleResult, Phase, table_roles, trained_in
from dmd2_mega.methods.roles import enter_phase
from dmd2_mega.methods.trainer import StudentTrainer
from dmd2_mega.train.checkpoint import load_payload
from dmd2_mega.train.checkpoint_guard import RESUME_SETTINGS
from dmd2_mega.train.optim import step_optimizer
from tests.utils import read_trace, world_of_one

pytestmark = pytest.mark.timeout(300)
TEACHER_STEPS = 4


class RegressMethod:
    """Plain regression of a one-step student onto the teacher's 4-step sampler (see the module docstring)."""

    name = "regress"
    PHASES = (Phase("teacher", {"teacher": "all"}), Phase("regress", {"student": "all"}, trains="student"))
    roles = table_roles(PHASES)                   # teacher, student
    trained = tuple(trained_in(PHASES).values())  # student
    eval_phase = "regress"
    data_factor = 1
    reads_samples = False
    resume_settings = RESUME_SETTINGS
    entered: list = []  # (phase, roles resident after entering it): what the test checks

    def __init__(self, cfg, shape, device):
        self.cfg, self.shape, self.device = cfg, tuple(shape), device
        self.phases = self.PHASES
        self.student_sigmas = torch.ones(1, device=device)  # one step from pure noise

    def _enter(self, phase, roles, hook):
        hook(phase)
        resident = enter_phase(phase, roles, self.phases)
        awake = sorted(n for n, r in roles.items() if r.resident_bytes() > 0)
        RegressMethod.entered.append((phase, awake))
        return resident

    def targets(self, teacher, batches):
        """(noise, the teacher's 4-step samples) per micro-batch."""
        out = []
        with torch.no_grad():
            for mb in batches:
                x_t = torch.randn((len(mb.cond), *self.shape), generator=mb.rollout_gen, device=self.device)
                y = flow.euler_sampler(teacher.model, x_t, mb.cond, steps=TEACHER_STEPS,
                                       shift=self.cfg.train.timestep_shift)
                out.append((x_t, y))
        return out

    def regression_loss(self, student, x_t, y, cond):
        sigma = torch.ones(len(x_t), device=x_t.device)
        x0hat = x_t - student.model(x_t, sigma, cond).to(x_t.dtype)
        return (x0hat.float() - y.float()).square().mean()

    def cycle(self, roles, batches, hook=None):
        hook = hook or (lambda phase: None)
        resident = {"teacher": self._enter("teacher", roles, hook)}
        pairs = self.targets(roles["teacher"], batches)
        resident["regress"] = self._enter("regress", roles, hook)
        student, m = roles["student"], len(batches)
        total = torch.zeros((), device=self.device)
        for j, ((x_t, y), mb) in enumerate(zip(pairs, batches)):
            with student.accumulating(last=j == m - 1):
                loss = self.regression_loss(student, x_t, y, mb.cond)
                (loss / m).backward()
            total = total + loss.detach() / m
        norm = step_optimizer(student.optimizer, total)
        student.optimizer.zero_grad()
        return CycleResult({"regress-loss": total, "regress-grad_norm": norm.to(total.device)}, resident)

    def init_model(self, name, model, state, load):
        """The teacher's weights; the student's halved, so that it starts away from the teacher's sampler."""
        load(model, state)
        if name == "student":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        return model

    def load_hint(self, name, state):
        return ""

    def describe(self, num_micro_batches, null_note):
        return f"M={num_micro_batches}; teacher steps {TEACHER_STEPS}"

    def describe_parts(self, roles):
        return "no parts"

    def plan_offload(self, cfg, ps, info, budget):
        return frozenset(), {p.name: 0 for p in self.phases}, True

    def flops_per_iter(self, per_sample, num_micro_batches):
        return None


def args(teacher: str, save: str, iters: int, *more) -> list:
    return ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4", "--global-batch-size", "8",
            "--lr", "3e-3", "--lr-decay-iters", "1000", "--train-iters", str(iters), "--log-interval", "1",
            "--seed", "3", "--save", save, "--loss-trace", save + ".trace.jsonl", *more]


def fixed_batch_loss(tr: StudentTrainer) -> float:
    """The regression loss of one fixed batch (its own generator) under the student's current weights."""
    for role in tr.roles.values():  # both roles at once: outside the cycle's phases
        if role.sleeper is not None:
            role.sleeper.wake()
    gen = torch.Generator().manual_seed(11)
    cond = torch.arange(8) % 10
    x_t = torch.randn((8, *tr.shape), generator=gen)
    with torch.no_grad():
        y = flow.euler_sampler(tr.roles["teacher"].model, x_t, cond, steps=TEACHER_STEPS,
                               shift=tr.cfg.train.timestep_shift)
        return float(tr.method.regression_loss(tr.roles["student"], x_t, y, cond))


def test_a_second_method_runs_through_the_shared_trainer(debug_teacher, tmp_path):
    save = str(tmp_path / "student")
    RegressMethod.entered.clear()
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(debug_teacher, save, 4, "--offload-inactive")), RegressMethod)
        assert set(tr.roles) == {"teacher", "student"}, "the table names two roles: no critic is built"
        assert tr.roles["teacher"].optimizer is None and tr.roles["student"].optimizer is not None
        teacher_before = [p.detach().clone() for p in tr.roles["teacher"].model.parameters()]
        student_before = [p.detach().clone() for p in tr.roles["student"].model.parameters()]
        before = fixed_batch_loss(tr)
        tr.train()
        after = fixed_batch_loss(tr)
        assert tr.iteration == 4
        assert RegressMethod.entered[:2] == [("teacher", ["teacher"]), ("regress", ["student"])], \
            "each phase keeps exactly the roles its table names resident (--offload-inactive)"
        assert [p for p, _ in RegressMethod.entered] == ["teacher", "regress"] * 4
        assert all(torch.equal(a, b) for a, b in zip(tr.roles["teacher"].model.parameters(), teacher_before))
        assert any(not torch.equal(a, b) for a, b in zip(tr.roles["student"].model.parameters(), student_before))
        assert after < 0.7 * before, f"the student did not learn the teacher's sampler: {before} -> {after}"
        final = {n: p.detach().clone() for n, p in tr.roles["student"].model.named_parameters()}
        ps = tr.ps
    trace = read_trace(save + ".trace.jsonl")
    assert [r["iteration"] for r in trace] == [1, 2, 3, 4]
    assert all(set(r) >= {"regress-loss", "regress-grad_norm"} for r in trace)
    payload = load_payload(save, ps)
    assert payload["role"] == "student" and payload["iteration"] == 4 and payload["student_sigmas"] == [1.0]
    assert not os.path.exists(save + "_critic"), "a method without a critic writes no <save>_critic"

    # resume: the shared pair checkpoint with a one-role "pair"
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(debug_teacher, save, 5, "--load", save)), RegressMethod)
        assert tr.iteration == 4
        for n, p in tr.roles["student"].model.named_parameters():
            assert torch.equal(p, final[n]), f"{n} was not resumed bit-exactly"
        tr.train()
        assert tr.iteration == 5
