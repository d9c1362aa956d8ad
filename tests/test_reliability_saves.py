"""Crash-safe checkpoints: a process killed at any stage of a save leaves the tracker pointing at a
complete checkpoint, and the student and <save>_critic of one DMD2 cycle resume as a pair.

In-process, every stage of `dmd2_mega.train.resilience.KILL_STAGES`: `checkpoint.kill_point` is replaced
by one that raises `Crash` at the stage (a BaseException: the save cleans up after an Exception, a failed
write, but not after a kill, so the disk is left as a SIGKILL there would leave it; the rank file is fsync'd
before each stage).
Debug flow model, checkpoint at iteration 2, the save of iteration 3 crashes; then
  - the tracker still says 2 and its files pass the CRC check,
  - a resume (--load) starts at 2 with the iteration-2 weights, trains to 4 and leaves no *.tmp.
DMD2 (debug, B=4, K=2): saves at cycle 2, the save of cycle 4 crashes; the resume loads the
student AND the critic of cycle 2 (their weights equal the cycle-2 files, not cycle 4's), even when
the critic's tracker already says 4 (between-trackers).
Two real SIGKILLs through the test hook DMD2_MEGA_TEST_KILL_AT (launch scripts in subprocesses):
flow at before-tracker@4, DMD2 at between-trackers@4; exit status -9, then the same checks.
"""
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dmd2_mega.train import checkpoint
from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import latest_iteration, load_payload
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.errors import CheckpointError
from dmd2_mega.distributed.parallel import ParallelState
from dmd2_mega.train.resilience import KILL_ENV
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import PRETRAIN, PRETRAIN_DMD2, find_tmp, run, world_of_one
from tests.utils import RESUMABLE_FLOW as FLOW, resumable_dmd2_args as dmd2_args

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("killed",)  # fixtures that launch processes: their tests are marked integration



class Crash(BaseException):
    """A kill, not an error: the save's failure handling (which catches any Exception) does not see it."""


def crash_at(monkeypatch, stage: str, iteration: int) -> None:
    def kill_point(s, it):
        if s == stage and it == iteration:
            raise Crash(stage)
    monkeypatch.setattr(checkpoint, "kill_point", kill_point)


def flow(argv: list) -> FlowTrainer:
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + argv))
        tr.train()
    return tr


def dmd2(teacher: str, argv: list) -> DMD2Trainer:
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + argv))
        tr.train()
    return tr


def weights(root: str, it: int) -> dict:
    """The model of `root` at iteration `it` (read, like a resume, after the CRC check)."""
    ps = ParallelState(rank=0, world_size=1, local_rank=0, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1,
                       device=torch.device("cpu"), backend="gloo")
    return load_payload(root, ps, iteration=it)["model"]


def assert_same(model: torch.nn.Module, state: dict, what: str) -> None:
    for n, w in model.state_dict().items():
        if torch.is_tensor(w):
            assert torch.equal(w, state[n]), f"{what}: {n} differs"


@pytest.fixture(scope="module")
def teacher(debug_teacher):
    return debug_teacher


# ---- flow, every stage in-process --------------------------------------------------------------

@pytest.mark.parametrize("stage", ["rank-file-tmp", "rank-file", "before-dir-rename", "before-tracker"])
def test_flow_crash_mid_save_resumes_from_previous(tmp_path, monkeypatch, stage):
    save = str(tmp_path / "ck")
    flow(["--train-iters", "2", "--save", save])
    crash_at(monkeypatch, stage, 3)
    with pytest.raises(Crash):
        flow(["--train-iters", "3", "--save", save, "--load", save])
    assert latest_iteration(save) == 2
    at2 = weights(save, 2)
    monkeypatch.undo()
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "4", "--save", save, "--load", save]))
        assert tr.iteration == 2
        assert_same(tr.model, at2, "resumed weights vs the iteration-2 checkpoint")
        tr.train()
    assert latest_iteration(save) == 4 and not find_tmp(save), find_tmp(save)


def test_flow_crash_while_resaving_an_iteration_falls_back_to_old(tmp_path, monkeypatch):
    """A re-save of the committed iteration moves iter_N/ aside first; a kill right then leaves only
    iter_N.old/, which the load uses."""
    save = str(tmp_path / "ck")
    tr = flow(["--train-iters", "2", "--save", save])
    before = weights(save, 2)
    crash_at(monkeypatch, "old-aside", 2)
    with world_of_one(), pytest.raises(Crash):
        tr.save()
    it2 = os.path.join(save, "iter_0000002")
    assert not os.path.isdir(it2) and os.path.isdir(it2 + ".old")
    after = weights(save, 2)
    assert all(torch.equal(before[k], after[k]) for k in before if torch.is_tensor(before[k]))


# ---- DMD2: student and critic commit together ----------------------------------------------------

@pytest.mark.parametrize("stage", ["rank-file", "before-tracker", "between-trackers"])
def test_dmd2_crash_mid_save_resumes_matching_pair(teacher, tmp_path, monkeypatch, stage):
    save = str(tmp_path / "student")
    dmd2(teacher, ["--train-iters", "2", "--save", save])
    s2, c2 = weights(save, 2), weights(save + "_critic", 2)
    crash_at(monkeypatch, stage, 4)
    with pytest.raises(Crash):
        dmd2(teacher, ["--train-iters", "4", "--save", save, "--load", save])
    assert latest_iteration(save) == 2
    if stage == "between-trackers":  # the critic's tracker moved on; the commit (the student's) did not
        assert latest_iteration(save + "_critic") == 4
    monkeypatch.undo()
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--train-iters", "5", "--save", save, "--load", save]))
        assert tr.iteration == 2
        assert_same(tr.roles["student"].model, s2, "resumed student vs cycle 2")
        assert_same(tr.roles["critic"].model, c2, "resumed critic vs cycle 2")
        tr.train()
    assert latest_iteration(save) == latest_iteration(save + "_critic") == 5
    assert not find_tmp(save) and not find_tmp(save + "_critic")


def test_dmd2_critic_of_another_run_is_refused(teacher, tmp_path):
    """Same cycle number, different save (e.g. --save reused by another run): a clear error, not a
    silent pairing."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dmd2(teacher, ["--train-iters", "2", "--save", a])
    dmd2(teacher, ["--train-iters", "2", "--save", b, "--seed", "4"])
    crit = os.path.join(a + "_critic", "iter_0000002")
    os.rename(crit, crit + ".mine")
    os.rename(os.path.join(b + "_critic", "iter_0000002"), crit)
    with world_of_one(), pytest.raises(CheckpointError, match=r"_critic: none of .* was saved together with the "
                                                              r"student checkpoint being resumed"):
        DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--train-iters", "3", "--load", a]))
    os.rename(crit + ".mine", crit + ".old")  # the matching save, in the re-save fallback slot: found
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--train-iters", "3", "--load", a]))
        assert tr.iteration == 2


# ---- real SIGKILLs through the test hook -----------------------------------------------------------

@pytest.fixture(scope="module")
def killed(teacher, tmp_path_factory):
    d = tmp_path_factory.mktemp("rel_kill")
    jobs = {"flow": ([PRETRAIN] + FLOW + ["--train-iters", "4", "--save-interval", "2", "--save", d / "flow"],
                     "before-tracker@4"),
            "dmd2": ([PRETRAIN_DMD2] + dmd2_args(teacher) + ["--train-iters", "4", "--save-interval", "2",
                                                           "--save", d / "dmd2"], "between-trackers@4")}
    with ThreadPoolExecutor(2) as pool:
        futs = {k: pool.submit(run, [sys.executable, *cmd], 240, {KILL_ENV: spec}) for k, (cmd, spec) in jobs.items()}
        res = {k: f.result() for k, f in futs.items()}
    return {"d": d, "res": res}


def test_sigkill_during_flow_save(killed):
    res, save = killed["res"]["flow"], str(killed["d"] / "flow")
    assert res.returncode == -signal.SIGKILL, res.tail()
    assert "saved checkpoint at iteration 2" in res.stdout and "iteration 4 to" not in res.stdout, res.tail()
    assert latest_iteration(save) == 2 and os.path.isdir(os.path.join(save, "iter_0000004"))  # complete, uncommitted
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "4", "--load", save]))
        assert tr.iteration == 2
        assert_same(tr.model, weights(save, 2), "resume after SIGKILL")


def test_sigkill_between_dmd2_trackers(killed, teacher):
    res, save = killed["res"]["dmd2"], str(killed["d"] / "dmd2")
    assert res.returncode == -signal.SIGKILL, res.tail()
    assert latest_iteration(save) == 2 and latest_iteration(save + "_critic") == 4
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--train-iters", "4", "--load", save]))
        assert tr.iteration == 2
        assert_same(tr.roles["critic"].model, weights(save + "_critic", 2), "critic paired with the cycle-2 student")
        c4 = weights(save + "_critic", 4)
        assert any(not torch.equal(w, c4[n]) for n, w in tr.roles["critic"].model.state_dict().items()
                   if torch.is_tensor(w)), "cycle 2 and cycle 4 critics should differ (else the test is blind)"
