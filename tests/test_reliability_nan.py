"""Non-finite losses and gradient norms: the step is skipped (weights and AdamW state untouched),
counted per role, and --max-nan-iterations consecutive skips stop the run naming the role.

  a. Optimizer: the sequence [good, NaN grads, finite grads with an inf loss, good] leaves the
     parameters and AdamW state (moments, step counts) EQUAL to a reference optimizer that took only
     the two good steps; fp32 and bf16 (fp32 masters) parameters.
  b. FlowTrainer.train_step on a NaN batch: weights and optimizer state unchanged, counted; train()
     with every batch from iteration 3 on poisoned, --max-nan-iterations 3 and saves every 2
     iterations: warnings, "number of nan iterations" in the log, checkpoints at 2 and 4 with
     identical weights (the skips changed nothing), then NonFiniteError naming the model and
     iteration 5, and nothing saved at 5. The counters are read at the loop's check points (multiples of
     --log-interval or --save-interval, the last iteration), so with --log-interval 4 the same run stops at
     the check point after the limit: iteration 8 (6 with --save-interval 6, checked before that save,
     which is not written), the error still naming iteration 5, the iteration that reached the limit.
  c. DMD2: a forward hook makes the student's grad-enabled forward (the actor step; the rollout runs
     without grad) return NaN for one cycle: the student's weights and AdamW state stay, the
     critic's move; the next clean cycle steps the student again. A permanent NaN critic: both of
     its K = 2 steps per cycle are skipped; with --max-nan-iterations 3 the run stops after cycle 2
     naming the critic, the log counts "critic nan iterations", and no checkpoint is written.
"""
import copy

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import latest_iteration, load_payload
from dmd2_mega.config import OptimConfig
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.errors import NonFiniteError
from dmd2_mega.train.optim import Optimizer
from dmd2_mega.distributed.parallel import ParallelState
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(240)

FLOW = ["--model-size", "debug", "--micro-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--seed", "5"]
NAN = float("nan")


def snapshot(model: torch.nn.Module, opt: Optimizer) -> tuple:
    """Weights and AdamW state (moments, step counts; not the lr, which the schedule sets each step)."""
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["inner"]["state"])


def assert_equal_state(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_equal_state(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_state(x, y, f"{what}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), f"{what} changed"
    else:
        assert a == b, f"{what}: {a} vs {b}"


# ---- a. the optimizer ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skipped_steps_equal_steps_never_taken(dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(dtype)
    ref = copy.deepcopy(model)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    opt, ref_opt = Optimizer(model, cfg), Optimizer(ref, cfg)
    good = [torch.randn(3, 6).to(dtype) for _ in range(2)]

    def step(o, m, g, loss=None, bias=0.0):
        m.weight.grad, m.bias.grad = g.clone(), torch.full((3,), bias, dtype=dtype)
        norm = o.step(None if loss is None else torch.tensor(loss))
        o.zero_grad()
        return norm

    assert torch.isfinite(step(opt, model, good[0], loss=1.0))
    assert torch.isnan(step(opt, model, good[1], bias=NAN))                    # NaN gradient
    assert (opt.skipped_steps, opt.consecutive_skips) == (1, 1)
    assert torch.isfinite(step(opt, model, good[1], loss=float("inf")))        # finite grads, inf loss
    assert (opt.skipped_steps, opt.consecutive_skips) == (2, 2)
    step(opt, model, good[1], loss=2.0)
    assert (opt.skipped_steps, opt.consecutive_skips) == (2, 0)
    for g in good:
        step(ref_opt, ref, g)
    assert_equal_state(model.state_dict(), ref.state_dict(), "weights")
    assert_equal_state(opt.state_dict(), ref_opt.state_dict(), "optimizer")
    assert float(opt.inner.state_dict()["state"][0]["step"]) == 2


# ---- b. the flow trainer ------------------------------------------------------------------------

def test_flow_train_step_skips_a_nan_batch():
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "4"]))
        tr.train_step()
        before = snapshot(tr.model, tr.optimizer)
        clean = tr.dataset.get_batch
        tr.dataset.get_batch = lambda idx: (torch.full_like(clean(idx)[0], NAN), clean(idx)[1])
        loss, norm, _ = tr.train_step()
        assert torch.isnan(loss) and tr.optimizer.skipped_steps == 1 and tr.iteration == 2
        assert_equal_state(snapshot(tr.model, tr.optimizer), before, "after a NaN batch")
        tr.dataset.get_batch = clean
        tr.train_step()
        assert tr.optimizer.consecutive_skips == 0
        assert any(not torch.equal(w, before[0][k]) for k, w in tr.model.state_dict().items() if torch.is_tensor(w))


def test_flow_stops_after_max_nan_iterations(tmp_path, capsys):
    save = str(tmp_path / "ck")
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "10", "--save", save, "--save-interval", "2",
                                                 "--max-nan-iterations", "3"]))
        clean = tr.dataset.get_batch
        tr.dataset.get_batch = lambda idx: ((clean(idx)[0] * (NAN if tr.iteration >= 2 else 1.0)), clean(idx)[1])
        with pytest.raises(NonFiniteError, match=r"model: 3 consecutive optimizer steps with a non-finite loss or "
                                                 r"gradient norm, the last at iteration 5 \(--max-nan-iterations 3\)"):
            tr.train()
    out = capsys.readouterr().out
    assert "WARNING: iteration 3: skipped 1 model optimizer step(s)" in out, out[-2000:]
    assert "number of nan iterations: 1 |" in out and "number of nan iterations: 0 |" in out
    assert latest_iteration(save) == 4
    ps = ParallelState(0, 1, 0, 0, 1, 0, 1, torch.device("cpu"), "gloo")
    w2, w4 = (load_payload(save, ps, iteration=i)["model"] for i in (2, 4))
    assert_equal_state(w4, w2, "weights at 4 vs 2 (iterations 3-4 were skipped)")


@pytest.mark.parametrize("flags, at", [([], 8), (["--save-interval", "6"], 6)], ids=["log-interval", "save-interval"])
def test_flow_nan_stop_comes_at_the_next_check_point(flags, at, tmp_path, capsys):
    save = str(tmp_path / "ck")
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "20", "--log-interval", "4", "--save", save,
                                                 "--max-nan-iterations", "3", *flags]))
        clean = tr.dataset.get_batch
        tr.dataset.get_batch = lambda idx: ((clean(idx)[0] * (NAN if tr.iteration >= 2 else 1.0)), clean(idx)[1])
        with pytest.raises(NonFiniteError, match=r"model: 3 consecutive .* the last at iteration 5 "):
            tr.train()
        assert tr.iteration == at, "the stop comes at the first check point after the limit"
    out = capsys.readouterr().out
    assert "WARNING: iteration 3: skipped 1 model optimizer step(s)" in out, out[-2000:]
    assert latest_iteration(save) is None, "no checkpoint after the iteration that reached the limit"


# ---- c. DMD2 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher(debug_teacher):
    return debug_teacher


def dmd2_cfg(teacher: str, *extra):
    return parse_dmd2_args(["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4",
                            "--lr", "1e-3", "--dmd2-critic-steps-per-rollout", "2", "--log-interval", "1",
                            "--seed", "3", "--no-offload-inactive", *extra])


def nan_forward(model: torch.nn.Module, only_with_grad: bool):
    def hook(module, args, out):
        return out * NAN if torch.is_grad_enabled() or not only_with_grad else out
    return model.register_forward_hook(hook)


def test_dmd2_nan_student_step_is_skipped(teacher):
    with world_of_one():
        tr = DMD2Trainer(dmd2_cfg(teacher, "--train-iters", "3"))
        tr.cycle()
        student, critic = tr.roles["student"], tr.roles["critic"]
        s1, c1 = snapshot(student.model, student.optimizer), snapshot(critic.model, critic.optimizer)
        handle = nan_forward(student.model, only_with_grad=True)
        out = tr.cycle()
        handle.remove()
        assert out["skipped"] == {"critic": 0, "student": 1}
        # the DMD loss itself stays finite (nan_to_num of its gradient); the NaN gradient norm trips the skip
        assert torch.isnan(out["metrics"]["actor-grad_norm"]) and torch.isfinite(out["metrics"]["critic-loss"])
        assert_equal_state(snapshot(student.model, student.optimizer), s1, "student after a skipped actor step")
        assert not torch.equal(critic.model.state_dict()["x_embed.weight"], c1[0]["x_embed.weight"])
        out = tr.cycle()
        assert out["skipped"] == {"critic": 0, "student": 0} and student.optimizer.consecutive_skips == 0
        assert float(student.optimizer.inner.state_dict()["state"][0]["step"]) == 2


def test_dmd2_stops_naming_the_critic(teacher, tmp_path, capsys):
    save = str(tmp_path / "student")
    with world_of_one():
        tr = DMD2Trainer(dmd2_cfg(teacher, "--train-iters", "10", "--save", save, "--max-nan-iterations", "3"))
        nan_forward(tr.roles["critic"].model, only_with_grad=False)
        with pytest.raises(NonFiniteError, match=r"critic: 4 consecutive optimizer steps .* the last at cycle 2 "
                                                 r"\(--max-nan-iterations 3\)"):
            tr.train()
        assert tr.roles["student"].optimizer.skipped_steps == 0  # x0_fake NaN -> nan_to_num: the student steps
    out = capsys.readouterr().out
    assert "critic nan iterations: 2 |" in out and "actor nan iterations: 0 |" in out, out[-2000:]
    assert latest_iteration(save) is None, "a stopped run must not write a checkpoint"
