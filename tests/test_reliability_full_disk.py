"""A full disk during a checkpoint save (issue 27, item 3): whatever exception the writer raises (an OSError,
torch's zip writer's `RuntimeError: ... unexpected pos A vs B` wrapping one, anything else), on whichever rank,
every rank fails the save with the same one-line CheckpointError naming the file and the cause, iter_N.tmp/ is
removed, the previous checkpoint and its tracker are byte-for-byte unchanged, and a rerun with space resumes
from it and saves.

Real disks: a tmpfs (mount(2) through libc, as root; skipped with the reason where mounting is not permitted)
holds the cycle-2 checkpoint and a filler file (posix_fallocate) that leaves a chosen number of free pages,
sized from the checkpoint's own files so that the save of iteration 4 fails in a chosen file: the flow model's
rank file or its tracker; DMD2's critic file, student file or critic tracker (the student's tracker cannot be
reached by size: replacing the critic's frees a block). Each test asserts the file named in the error, so a size
that lands elsewhere fails the test rather than testing something else.
Two ranks (torchrun, gloo): DP=2 (only rank 0 writes; rank 1 learns of the failure through the vote) and TP=2
(both write, one rank's file does not fit); both ranks print the same line and exit 1, none on gloo's
"Connection closed by peer".
Patched writers (everywhere): torch's real zip writer on a file that runs out of space after a few bytes, an
exception of another type, a tracker that cannot be written, and the one-process writer of conversions.
"""
import contextlib
import ctypes
import errno
import hashlib
import io
import math
import os
import re
import shutil

import pytest
import torch

from dmd2_mega.train import checkpoint
from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import TRACKER, latest_iteration, load_payload, save_offline
from dmd2_mega.train.curves import CURVES_FILE
from dmd2_mega.train.curves_plot import CURVES_PNG
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.errors import CheckpointError
from dmd2_mega.distributed.parallel import ParallelState
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import PRETRAIN, find_tmp, torchrun, world_of_one
from tests.utils import RESUMABLE_FLOW as FLOW

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("tp2_checkpoint",)  # fixtures that launch processes: their tests are marked integration

RANK0 = os.path.join("iter_0000004.tmp", "mp_rank_00", "model_optim_rng.pt")
LIBC = ctypes.CDLL(None, use_errno=True)


def dmd2_args(teacher: str) -> list:
    return ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "2", "--lr", "1e-3",
            "--dmd2-critic-steps-per-rollout", "2", "--log-interval", "1", "--seed", "3", "--no-offload-inactive",
            "--lr-decay-iters", "1000"]


@contextlib.contextmanager
def tmpfs(path: str, size: int):
    """A tmpfs of `size` bytes mounted at `path` for the block; pytest.skip with the reason where mount(2) is refused."""
    os.makedirs(path, exist_ok=True)
    if LIBC.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, f"size={size}".encode()) != 0:
        reason = os.strerror(ctypes.get_errno())
        print(f"cannot mount a tmpfs at {path}: {reason}")
        pytest.skip(f"a real full disk needs a tmpfs, and mount(2) is not permitted here ({reason}; run as root)")
    try:
        yield path
    finally:
        if LIBC.umount2(os.fsencode(path), 0) != 0:
            LIBC.umount2(os.fsencode(path), 2)  # MNT_DETACH: a file still open in it


def pages(path: str) -> int:
    """Blocks of the filesystem holding `path` that the file takes."""
    return math.ceil(os.path.getsize(path) / os.statvfs(path).f_frsize)


def leave_free(mount: str, free: int) -> str:
    """Fill `mount` with one file so that exactly `free` blocks remain; returns the filler's path."""
    st = os.statvfs(mount)
    filler = os.path.join(mount, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, (st.f_bavail - free) * st.f_frsize)
    finally:
        os.close(fd)
    assert os.statvfs(mount).f_bavail == free, "the filler should leave exactly the blocks asked for"
    return filler


def files(*roots: str) -> dict:
    """{path: sha256} of every checkpoint file under `roots` (the run lock, which names its holder, and the run's
    curves, which record every run, aside)."""
    out = {}
    for root in roots:
        for d, _, names in os.walk(root):
            for n in names:
                if n not in (".dmd2_mega.lock", CURVES_FILE, CURVES_PNG):
                    p = os.path.join(d, n)
                    out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def rank_file(root: str, it: int, tp_rank: int = 0) -> str:
    return checkpoint.rank_file(checkpoint.iter_dir(root, it), tp_rank)


def weights(root: str, it: int) -> dict:
    ps = ParallelState(rank=0, world_size=1, local_rank=0, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1,
                       device=torch.device("cpu"), backend="gloo")
    return load_payload(root, ps, iteration=it)["model"]


def flow(argv: list) -> None:
    with world_of_one():
        FlowTrainer(parse_flow_args(FLOW + argv)).train()


def dmd2(teacher: str, argv: list) -> None:
    with world_of_one():
        DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + argv)).train()


def failed_at(what: str, root: str, rest: str, cause: str = "No space left on device") -> str:
    """The error's pattern: the save of iteration 4 to `root` failed with `cause` in `what` (a regex), then `rest`."""
    return rf"^saving iteration 4 to {re.escape(root)} failed: {re.escape(cause)} \({what}\); {rest}"


PARTIAL = r"the partial iter_0000004.tmp/ was removed and the latest checkpoint is still iteration 2$"
UNCOMMITTED = r"iter_0000004/ is complete but not committed and the latest checkpoint is still iteration 2$"


# ---- a real full disk, one rank --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_ck(tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("flow") / "ck")
    flow(["--train-iters", "2", "--save", save])
    return save


@pytest.mark.parametrize("lands", ["rank file", "tracker"])
def test_flow_save_on_a_full_disk(flow_ck, tmp_path, lands):
    with tmpfs(str(tmp_path / "disk"), 4 << 20) as disk:
        save = os.path.join(disk, "ck")
        shutil.copytree(flow_ck, save)
        rank = pages(rank_file(save, 2))
        filler = leave_free(disk, {"rank file": rank // 2, "tracker": rank}[lands])
        before = files(save)
        what, rest = {"rank file": (f"writing {re.escape(RANK0)}", PARTIAL),
                      "tracker": (f"writing {re.escape(os.path.join(save, TRACKER))}", UNCOMMITTED)}[lands]
        with pytest.raises(CheckpointError, match=failed_at(what, save, rest)):
            flow(["--train-iters", "4", "--save", save, "--load", save])
        assert not find_tmp(save), find_tmp(save)
        assert {p: h for p, h in files(save).items() if "iter_0000004" not in p} == before
        assert os.path.isdir(os.path.join(save, "iter_0000004")) == (lands == "tracker")
        if lands == "tracker":  # complete, uncommitted: its file passes the CRC check
            assert weights(save, 4)
        os.remove(filler)  # space again: the rerun resumes from iteration 2 and commits 4
        flow(["--train-iters", "4", "--save", save, "--load", save])
        assert latest_iteration(save) == 4 and not find_tmp(save)


@pytest.fixture(scope="module")
def dmd2_ck(debug_teacher, tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("dmd2") / "student")
    dmd2(debug_teacher, ["--train-iters", "2", "--save", save])
    return save


@pytest.mark.parametrize("lands", ["critic file", "student file", "critic tracker"])
def test_dmd2_save_on_a_full_disk(debug_teacher, dmd2_ck, tmp_path, lands):
    with tmpfs(str(tmp_path / "disk"), 8 << 20) as disk:
        save = os.path.join(disk, "student")
        critic = save + "_critic"
        shutil.copytree(dmd2_ck, save)
        shutil.copytree(dmd2_ck + "_critic", critic)
        c, s = pages(rank_file(critic, 2)), pages(rank_file(save, 2))
        filler = leave_free(disk, {"critic file": c // 2, "student file": c + s // 2, "critic tracker": c + s}[lands])
        before = files(save, critic)
        pattern = {"critic file": failed_at(f"writing {re.escape(RANK0)}", critic, PARTIAL),
                   "student file": failed_at(f"writing {re.escape(RANK0)}", save, PARTIAL),
                   "critic tracker": failed_at(f"writing {re.escape(os.path.join(critic, TRACKER))}", save,
                                               UNCOMMITTED)}[lands]
        with pytest.raises(CheckpointError, match=pattern):
            dmd2(debug_teacher, ["--train-iters", "4", "--save", save, "--load", save])
        assert not find_tmp(save) and not find_tmp(critic), find_tmp(save) + find_tmp(critic)
        assert {p: h for p, h in files(save, critic).items() if "iter_0000004" not in p} == before
        assert latest_iteration(save) == latest_iteration(critic) == 2
        # the critic's iteration-4 directory is complete once its file is written (uncommitted); the student's too
        # when only a tracker failed
        assert os.path.isdir(os.path.join(critic, "iter_0000004")) == (lands != "critic file")
        assert os.path.isdir(os.path.join(save, "iter_0000004")) == (lands == "critic tracker")
        os.remove(filler)
        dmd2(debug_teacher, ["--train-iters", "4", "--save", save, "--load", save])
        assert latest_iteration(save) == latest_iteration(critic) == 4
        assert not find_tmp(save) and not find_tmp(critic)


# ---- a real full disk, two ranks ---------------------------------------------------------------------------------

def assert_one_line_on_every_rank(res, pattern: str) -> str:
    """Each of the two ranks printed exactly one error line, the same one, matching `pattern`; no traceback or
    collective failure from a rank; exit 1. Returns the line."""
    assert res.returncode == 1, res.tail()
    lines = {r: [ln[len(f"[rank {r}] "):] for ln in res.stderr.splitlines() if ln.startswith(f"[rank {r}] ")]
             for r in (0, 1)}
    assert len(lines[0]) == len(lines[1]) == 1 and lines[0] == lines[1], res.tail()
    assert re.match(pattern, lines[0][0]), (pattern, lines[0][0])
    for bad in ("Traceback", "Connection closed", "unexpected pos"):
        assert bad not in res.stderr + res.stdout, res.tail()
    return lines[0][0]


@pytest.mark.integration
def test_two_ranks_dp2_first_save_on_a_full_disk(tmp_path):
    """The issue's reproduction: 96k cannot hold the first checkpoint; only rank 0 writes (DP=2)."""
    with tmpfs(str(tmp_path / "disk"), 96 << 10) as disk:
        save = os.path.join(disk, "ck")
        res = torchrun(2, PRETRAIN, ["--model-size", "debug", "--micro-batch-size", "4", "--lr", "3e-3", "--seed", "5",
                                     "--train-iters", "2", "--save", save])
        rank0 = re.escape(os.path.join("iter_0000002.tmp", "mp_rank_00", "model_optim_rng.pt"))
        assert_one_line_on_every_rank(res, rf"^CheckpointError: saving iteration 2 to {re.escape(save)} failed: No "
                                           rf"space left on device \(writing {rank0} on rank 0\); the partial "
                                           rf"iter_0000002.tmp/ was removed and the latest checkpoint is none yet$")
        assert sorted(os.listdir(save)) == [".dmd2_mega.lock", CURVES_FILE]  # the lock and the curve: no checkpoint


TP2 = ["--model-size", "debug", "--micro-batch-size", "8", "--lr", "3e-3", "--seed", "5", "--lr-decay-iters", "1000",
       "--tensor-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("tp2") / "ck")
    torchrun(2, PRETRAIN, TP2 + ["--train-iters", "2", "--save", save]).check("TP=2 checkpoint of iteration 2")
    return save


def test_two_ranks_tp2_one_rank_out_of_space(tp2_checkpoint, tmp_path):
    """Both ranks write; the space left holds one rank's file but not both: whichever rank runs out, both
    ranks print its line."""
    with tmpfs(str(tmp_path / "disk"), 4 << 20) as disk:
        save = os.path.join(disk, "ck")
        shutil.copytree(tp2_checkpoint, save)
        filler = leave_free(disk, pages(rank_file(save, 2, 0)) + pages(rank_file(save, 2, 1)) - 1)
        before = files(save)
        res = torchrun(2, PRETRAIN, TP2 + ["--train-iters", "4", "--save", save, "--load", save])
        rank_r = r"iter_0000004\.tmp/mp_rank_0(\d)/model_optim_rng\.pt on rank (\d)"
        line = assert_one_line_on_every_rank(res, rf"^CheckpointError: saving iteration 4 to {re.escape(save)} "
                                                  rf"failed: No space left on device \(writing {rank_r}\); {PARTIAL}")
        tp_rank, rank = re.search(rank_r, line).groups()
        assert tp_rank == rank, line  # TP=2 alone: rank r writes mp_rank_0r
        assert files(save) == before and not find_tmp(save)
        os.remove(filler)
        torchrun(2, PRETRAIN, TP2 + ["--train-iters", "4", "--save", save, "--load", save]).check("rerun with space")
        assert latest_iteration(save) == 4 and not find_tmp(save)


# ---- patched writers, everywhere ---------------------------------------------------------------------------------

class RunsOutOfSpace(io.RawIOBase):
    """A writable file that takes `room` bytes and then fails every write with ENOSPC, as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)


def patch_torch_save(monkeypatch, iteration: int, fail) -> None:
    """torch.save of the payload of `iteration` calls `fail(obj, f, real_save)` instead."""
    real_save = torch.save

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("iteration") == iteration:
            return fail(obj, f, real_save)
        return real_save(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", save)


def torch_zip_writer_full(obj, f, real_save):
    real_save(obj, RunsOutOfSpace(f, 4096))


def another_exception(obj, f, real_save):
    f.write(b"partial bytes")
    raise ValueError("cannot pickle 'generator' object\nsecond line")


@pytest.mark.parametrize("fail,cause", [(torch_zip_writer_full, "No space left on device"),
                                        (another_exception, "ValueError: cannot pickle 'generator' object")],
                         ids=["torch-zip-writer", "another-type"])
def test_any_writer_exception_is_one_checkpoint_error(tmp_path, monkeypatch, fail, cause):
    save = str(tmp_path / "ck")
    flow(["--train-iters", "2", "--save", save])
    before = files(save)
    patch_torch_save(monkeypatch, 4, fail)
    with pytest.raises(CheckpointError, match=rf"^saving iteration 4 to {re.escape(save)} failed: {re.escape(cause)} "
                                              rf"\(writing {re.escape(RANK0)}\); {PARTIAL}") as e:
        flow(["--train-iters", "4", "--save", save, "--load", save])
    assert "\n" not in str(e.value)
    assert files(save) == before and not find_tmp(save)


def test_a_tracker_that_cannot_be_written(tmp_path, monkeypatch):
    save = str(tmp_path / "ck")
    flow(["--train-iters", "2", "--save", save])
    real_write = checkpoint.atomic_write

    def atomic_write(path, write, **kw):
        if path.endswith(TRACKER):
            raise RuntimeError("[enforce fail at somewhere.cc:1] . a writer's own wording")
        return real_write(path, write, **kw)
    monkeypatch.setattr(checkpoint, "atomic_write", atomic_write)
    with pytest.raises(CheckpointError, match=failed_at(f"writing {re.escape(os.path.join(save, TRACKER))}", save,
                                                        UNCOMMITTED, "RuntimeError: [enforce fail at somewhere.cc:1] "
                                                                     ". a writer's own wording")):
        flow(["--train-iters", "4", "--save", save, "--load", save])
    assert open(os.path.join(save, TRACKER)).read() == "2" and not find_tmp(save)


@pytest.mark.parametrize("fails_at", ["rank file", "tracker"])
def test_offline_save_keeps_nothing_on_failure(tmp_path, monkeypatch, fails_at):
    """The conversions' writer: a failed write of any file leaves no iter_N/ and no tracker behind."""
    root = str(tmp_path / "converted")
    payloads = [{"iteration": 0, "w": torch.ones(4096)}, {"iteration": 0, "w": torch.zeros(4096)}]  # > the 4 KiB of room
    if fails_at == "rank file":
        patch_torch_save(monkeypatch, 0, torch_zip_writer_full)
        what = re.escape(os.path.join("iter_0000000.tmp", "mp_rank_00", "model_optim_rng.pt"))
    else:
        real_write = checkpoint.atomic_write

        def atomic_write(path, write, **kw):
            if path.endswith(TRACKER):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(path, write, **kw)
        monkeypatch.setattr(checkpoint, "atomic_write", atomic_write)
        what = TRACKER
    with pytest.raises(CheckpointError, match=rf"^writing {re.escape(root)} failed: No space left on device \({what}\); "
                                              rf"nothing was kept$"):
        save_offline(root, 0, iter(payloads))
    assert os.listdir(root) == []
