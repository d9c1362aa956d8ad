"""Guard rails around checkpoints (issue 13, items 1-3 and the full disk): roles are part of a checkpoint's
identity, a run never writes into a directory it loads in another role, one writer per directory, a resume
never changes meaning silently, a failed save leaves the previous checkpoint the latest. Each case checks the
error's text (the flag and both values) and that every checkpoint directory involved is byte-for-byte unchanged
(sha256 of all its files)."""
import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import TRACKER, latest_iteration
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import REPO, child_env, world_of_one

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("student",)  # fixtures that launch processes: their tests are marked integration
FLOW = ["--model-size", "debug", "--micro-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--seed", "5"]
DMD2 = ["--model-size", "debug", "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
        "--lr-decay-iters", "10", "--log-interval", "1"]


def tree_hash(root: str) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            h.update(open(path, "rb").read())
    return h.hexdigest()


@pytest.fixture
def teacher(debug_teacher, tmp_path):
    """A private copy of the session teacher (the tests may try to write into it)."""
    path = str(tmp_path / "teacher")
    shutil.copytree(debug_teacher, path)
    return path


@pytest.fixture(scope="module")
def student(debug_teacher, tmp_path_factory):
    """A DMD2 student + critic pair saved at cycle 2."""
    save = str(tmp_path_factory.mktemp("pair") / "student")
    with world_of_one():
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "2",
                                            "--save", save])).train()
    return save


def test_save_and_load_one_missing_folder_starts_fresh_then_resumes(debug_teacher, tmp_path):
    """Megatron's resume idiom, the quickstarts' (`--save D --load D`): while D does not exist the run starts from
    scratch (teacher) or from --teacher-load (student) and creates D; run again, it resumes from D. A --load that is
    not the run's --save and does not exist stays an error naming it."""
    teacher, student = str(tmp_path / "teacher"), str(tmp_path / "student")
    with world_of_one():
        for iters in ("1", "2"):
            FlowTrainer(parse_flow_args(FLOW + ["--train-iters", iters, "--save", teacher, "--load", teacher,
                                                "--lr-decay-iters", "10"])).train()
            assert latest_iteration(teacher) == int(iters)
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", iters,
                                                "--save", student, "--load", student])).train()
            assert latest_iteration(student) == latest_iteration(student + "_critic") == int(iters)
        missing = str(tmp_path / "missing")
        with pytest.raises(CheckpointError, match=f"^--load directory '{missing}' does not exist"):
            FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "1", "--save", teacher + "2", "--load", missing]))
        with pytest.raises(CheckpointError, match=f"^--load directory '{missing}' does not exist"):
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "1",
                                                "--save", student + "2", "--load", missing]))
    assert not os.path.exists(teacher + "2") and not os.path.exists(student + "2")  # a refused start leaves nothing


# ---- 1. roles ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_save_never_overlaps_the_teacher(teacher, where):
    save = {"same": teacher, "inside": os.path.join(teacher, "run"), "contains": os.path.dirname(teacher)}[where]
    before = tree_hash(teacher)
    how = {"same": "is", "inside": "lies inside", "contains": "contains"}[where]
    with world_of_one(), pytest.raises(ConfigError, match=rf"\(where the student is saved\) {how} --teacher-load "
                                                          r".* \(loaded as the teacher\), .*nothing was written"):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", teacher, "--train-iters", "1", "--save", save]))
    assert tree_hash(teacher) == before


def test_critic_sibling_never_overlaps_a_load(teacher, tmp_path):
    """--save R writes the critic into R_critic: a teacher kept in R_critic must be refused too."""
    save = str(tmp_path / "run")
    os.rename(teacher, save + "_critic")
    with world_of_one(), pytest.raises(ConfigError, match=r"--save's critic directory .*run_critic \(where the "
                                                          r"critic is saved\) is --teacher-load"):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", save + "_critic", "--train-iters", "1", "--save", save]))


def test_student_is_not_a_teacher(student, tmp_path):
    before = tree_hash(student)
    with world_of_one():
        with pytest.raises(CheckpointError, match=r"--teacher-load .* holds a student checkpoint, but --teacher-load "
                                                  r"takes a teacher checkpoint \(pass --allow-student-teacher"):
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", student, "--train-iters", "1"]))
        tr = DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", student, "--train-iters", "1",
                                                 "--allow-student-teacher"]))  # distilling a distilled model
        assert tr.roles["teacher"].model is not None
        with pytest.raises(CheckpointError, match=r"--load .* holds a student checkpoint, but --load takes a "
                                                  r"teacher checkpoint \(pretrain_flow.py resumes teachers only\)"):
            FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "2", "--load", student]))
        with pytest.raises(CheckpointError, match=r"--critic-load .* holds a student checkpoint"):
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", student, "--allow-student-teacher",
                                                "--critic-load", student, "--train-iters", "1"]))
    assert tree_hash(student) == before


def test_load_errors_name_the_flag_given(teacher, tmp_path):
    a_file = tmp_path / "file.pt"
    a_file.write_text("x")
    with world_of_one():
        with pytest.raises(CheckpointError, match=r"^--teacher-load '.*file.pt' is a file; expected a checkpoint"):
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", str(a_file), "--train-iters", "1"]))
        with pytest.raises(CheckpointError, match=r"^--critic-load directory '.*missing' does not exist"):
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", teacher, "--critic-load", str(tmp_path / "missing"),
                                                "--train-iters", "1"]))


def test_a_pickle_of_something_else_is_not_a_checkpoint(teacher):
    it = latest_iteration(teacher)
    path = os.path.join(teacher, f"iter_{it:07d}", "mp_rank_00", "model_optim_rng.pt")
    torch.save({"weights": torch.zeros(2)}, path)
    with world_of_one(), pytest.raises(CheckpointError, match=r"model_optim_rng.pt is not a dmd2-mega checkpoint: it "
                                                               r"holds a dict without \['tp_size', 'model'"):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", teacher, "--train-iters", "1"]))


# ---- 3. resume never changes meaning silently -----------------------------------------------------

def test_longer_train_iters_needs_a_schedule_decision(tmp_path):
    save = str(tmp_path / "t")
    with world_of_one():
        FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "4", "--save", save])).train()
        before = tree_hash(save)
        longer = FLOW + ["--train-iters", "8", "--load", save]
        with pytest.raises(CheckpointError, match=r"the LR schedule differs: --lr-decay-iters \(default: --train-iters\) "
                                                  r"was 4 when it was saved, this run has 8; pass "
                                                  r"--override-opt-param-scheduler .* --use-checkpoint-opt-param-sch"):
            FlowTrainer(parse_flow_args(longer))
        flags = FlowTrainer(parse_flow_args(longer + ["--override-opt-param-scheduler"]))
        assert flags.schedule.decay_iters == 8 and flags.iteration == 4 and flags.schedule(5) > 0
        kept = FlowTrainer(parse_flow_args(longer + ["--use-checkpoint-opt-param-scheduler"]))
        assert kept.schedule.decay_iters == 4 and kept.schedule(5) == 0.0  # the old schedule: decayed to --min-lr
        with pytest.raises(CheckpointError, match=r"--lr was 0.003 when it was saved, this run has 0.001"):
            FlowTrainer(parse_flow_args(longer + ["--lr", "1e-3", "--train-iters", "4"]))
    assert tree_hash(save) == before


@pytest.mark.parametrize("flags,message", [
    (["--dmd2-denoising-steps", "1"], r"the student's sigma grid \(--dmd2-denoising-steps / --dmd2-student-sigmas, "
                                      r"shifted\) was \[1.0, 0.75, 0.5, 0.25\] when it was saved, this run has \[1.0\]"),
    (["--dmd2-critic-steps-per-rollout", "3"], r"--dmd2-critic-steps-per-rollout was 2 when it was saved, this run "
                                               r"has 3"),
    (["--dmd2-critic-scoring", "original"], r"--dmd2-critic-scoring was shared when it was saved, this run has "
                                            r"original"),
    (["--micro-batch-size", "1"], r"--micro-batch-size was 2 when it was saved, this run has 1"),
])
def test_dmd2_resume_keeps_its_settings(debug_teacher, student, flags, message):
    before = (tree_hash(student), tree_hash(student + "_critic"))
    with world_of_one(), pytest.raises(CheckpointError, match=message):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "4", "--load", student]
                                    + flags))
    assert (tree_hash(student), tree_hash(student + "_critic")) == before


# ---- a full disk during a save ---------------------------------------------------------------------

def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save = str(tmp_path / "t")
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("iteration") == 4:
            f.write(b"partial bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "4", "--save", save, "--save-interval", "2"]))
        monkeypatch.setattr(torch, "save", full_disk)
        with pytest.raises(CheckpointError, match=r"saving iteration 4 to .* failed: No space left on device \(writing "
                                                  r"iter_0000004.tmp/mp_rank_00/model_optim_rng.pt\); the "
                                                  r"partial iter_0000004.tmp/ was removed and the latest checkpoint is "
                                                  r"still iteration 2"):
            tr.train()
    assert open(os.path.join(save, TRACKER)).read() == "2"
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]


# ---- 2. one writer per directory -------------------------------------------------------------------

def _start(save: str, iters: str = "100000") -> subprocess.Popen:
    cmd = [sys.executable, "-u", os.path.join(REPO, "launch", "pretrain_flow.py")] + FLOW + [
        "--train-iters", iters, "--save", save, "--save-interval", "1000000"]
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.mark.integration
def test_second_run_on_one_save_fails_naming_the_first(tmp_path):
    save = str(tmp_path / "t")
    first = _start(save)
    try:
        line = first.stdout.readline()
        while line and "iteration" not in line:  # the first log line: it holds the lock
            line = first.stdout.readline()
        assert line, first.stderr.read()[-2000:]
        start = time.time()
        second = subprocess.run([sys.executable, os.path.join(REPO, "launch", "pretrain_flow.py")] + FLOW + [
            "--train-iters", "2", "--save", save], cwd=REPO, env=child_env(), capture_output=True, text=True,
            timeout=120)
        assert second.returncode == 1 and time.time() - start < 60
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"CheckpointError: --save {save} is in use by another run (host "), err
        assert f"pid {first.pid}," in err[0], err[0]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    # the first run died holding the lock: the next run takes it over and says so
    third = subprocess.run([sys.executable, os.path.join(REPO, "launch", "pretrain_flow.py")] + FLOW + [
        "--train-iters", "1", "--save", save], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"took over the lock of {save} left by host" in third.stdout and f"pid {first.pid}" in third.stdout
