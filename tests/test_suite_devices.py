"""Where the suite's launched runs go on each machine (tests/utils.py, docs/testing.md "On a GPU machine"), checked
on a CPU by giving `tests.utils` the GPU count of another machine and catching the command instead of starting it.

On a CPU machine a torchrun has gloo ranks and may be a fork of the fork server; on a CUDA machine its ranks take a
GPU each, so a run of more ranks than GPUs is skipped with a reason naming both counts, a host-rank test script runs
with CUDA hidden, and nothing is forked (a process that touched the CUDA driver cannot hand it to a fork)."""
import sys

import pytest

from tests import forkserver, utils


@pytest.fixture
def caught(monkeypatch):
    """utils.run records (cmd, extra_env) instead of starting anything."""
    calls = []
    monkeypatch.setattr(utils, "run", lambda cmd, timeout=0, extra_env=None: calls.append((cmd, extra_env)))
    return calls


def test_cpu_machine_runs_every_rank_count_on_gloo_ranks(monkeypatch, caught):
    monkeypatch.setattr(utils, "GPUS", 0)
    utils.torchrun(8, utils.PRETRAIN, ["--train-iters", "1"])
    utils.torchrun(2, "tests/mp_scripts/grad_buffer_dp.py")
    assert [env for _, env in caught] == [None, None]  # nothing added: the fork server may run them


def test_gpu_machine_skips_runs_of_more_ranks_than_gpus_saying_so(monkeypatch, caught):
    monkeypatch.setattr(utils, "GPUS", 1)
    with pytest.raises(pytest.skip.Exception, match=r"needs 2 GPUs \(one per rank under NCCL\); this machine has 1"):
        utils.torchrun(2, utils.PRETRAIN, ["--train-iters", "1"])
    monkeypatch.setattr(utils, "GPUS", 2)
    utils.torchrun(2, utils.PRETRAIN, ["--train-iters", "1"], extra_env={"DMD2_MEGA_TEST_X": "1"})
    assert caught[-1][1] == {"DMD2_MEGA_TEST_X": "1"}  # enough GPUs: the ranks see them all
    with pytest.raises(pytest.skip.Exception, match="needs 4 GPUs"):
        utils.torchrun(4, utils.PRETRAIN)
    assert len(caught) == 1


def test_gpu_machine_runs_host_rank_scripts_with_cuda_hidden(monkeypatch, caught):
    monkeypatch.setattr(utils, "GPUS", 1)
    for name in sorted(utils.HOST_RANK_SCRIPTS):
        utils.torchrun(2, f"{utils.MP_SCRIPTS}/{name}")
    assert [env for _, env in caught] == [{"CUDA_VISIBLE_DEVICES": ""}] * len(utils.HOST_RANK_SCRIPTS)


def test_gpu_machine_starts_fresh_interpreters_not_forks(monkeypatch):
    """`run` on a CUDA machine takes Popen for a command the fork server would otherwise fork."""
    started = []

    class Refused(Exception):
        pass

    def popen(cmd, **kw):
        started.append(cmd)
        raise Refused

    cmd = [sys.executable, utils.PRETRAIN, "--help"]
    assert forkserver.forkable(cmd, None) or forkserver.os.environ.get(forkserver.ENV_SWITCH) == "0"
    monkeypatch.setattr(utils, "GPUS", 1)
    monkeypatch.setattr(utils.subprocess, "Popen", popen)
    monkeypatch.setattr(forkserver, "ForkedRun", lambda *a, **kw: pytest.fail("forked on a CUDA machine"))
    with pytest.raises(Refused):
        utils.run(cmd)
    assert started == [cmd]
