"""Preemption: --exit-signal-handler (SIGTERM) and --exit-duration-in-mins finish the current
iteration / cycle, save, and exit 0; a resume continues from there.

SIGTERM (subprocesses, flow and DMD2 debug runs of 100000 iterations with --log-interval 1): the
signal is sent once the first log line is out; the process must exit 0 within the timeout, print
"exiting at ... N", have logged iteration N, and hold a committed checkpoint at N (for DMD2 the
student and the critic); an in-process resume (--load) starts at N and reaches N + 2.
Duration (in-process, through the launch scripts' main(): its return value is the exit code): a
limit of 1e-5 minutes (0.6 ms) is past after the first iteration, so both scripts save at 1 and
return 0. ExitController alone: no flag -> never stops and installs no handler; close() restores
the previous SIGTERM handler.
"""
import importlib.util
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import latest_iteration
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.train.resilience import ExitController
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import LOGGED, PRETRAIN, PRETRAIN_DMD2, Result, signal_when_logged, world_of_one
from tests.utils import RESUMABLE_FLOW as FLOW, resumable_dmd2_args as dmd2_args

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("terminated",)  # fixtures that launch processes: their tests are marked integration



@pytest.fixture(scope="module")
def teacher(debug_teacher):
    return debug_teacher


@pytest.fixture(scope="module")
def terminated(teacher, tmp_path_factory):
    d = tmp_path_factory.mktemp("rel_term")
    jobs = {"flow": [sys.executable, PRETRAIN] + FLOW + ["--train-iters", "100000", "--exit-signal-handler",
                                                          "--save", d / "flow"],
            "dmd2": [sys.executable, PRETRAIN_DMD2] + dmd2_args(teacher) + [
                "--train-iters", "100000", "--exit-signal-handler", "--save", d / "dmd2"]}
    with ThreadPoolExecutor(2) as pool:
        futs = {k: pool.submit(signal_when_logged, cmd, signal.SIGTERM) for k, cmd in jobs.items()}
        return {k: (f.result(), str(d / k)) for k, f in futs.items()}


def _stopped_at(res: Result, unit: str) -> int:
    assert res.returncode == 0, f"SIGTERM with --exit-signal-handler must exit 0\n{res.tail()}"
    m = re.search(rf"> exiting at {unit} (\d+): SIGTERM received \(--exit-signal-handler\)", res.stdout)
    assert m, res.tail()
    n = int(m.group(1))
    assert int(LOGGED.findall(res.stdout)[-1]) == n, "the last iteration must be logged before the exit"
    return n


def test_sigterm_flow_saves_and_exits_0(terminated):
    res, save = terminated["flow"]
    n = _stopped_at(res, "iteration")
    assert latest_iteration(save) == n and f"saved checkpoint at iteration {n}" in res.stdout
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", str(n + 2), "--save", save, "--load", save]))
        assert tr.iteration == n
        tr.train()
    assert latest_iteration(save) == n + 2


def test_sigterm_dmd2_finishes_cycle_saves_pair_and_exits_0(terminated, teacher):
    res, save = terminated["dmd2"]
    n = _stopped_at(res, "cycle")
    assert latest_iteration(save) == latest_iteration(save + "_critic") == n
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--train-iters", str(n + 2), "--save", save,
                                                              "--load", save]))
        assert tr.iteration == n
        assert tr.roles["critic"].optimizer.inner.state_dict()["state"][0]["step"] == 2 * n  # K = 2 steps per cycle
        tr.train()
    assert latest_iteration(save) == latest_iteration(save + "_critic") == n + 2


def _main(script: str):
    spec = importlib.util.spec_from_file_location(f"launch_{os.path.basename(script)[:-3]}", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("kind", ["flow", "dmd2"])
def test_exit_duration_saves_and_returns_0(kind, teacher, tmp_path, capsys):
    save = str(tmp_path / "ck")
    script, args, unit = ((PRETRAIN, FLOW, "iteration") if kind == "flow" else
                          (PRETRAIN_DMD2, dmd2_args(teacher), "cycle"))
    with world_of_one():
        rc = _main(script)(args + ["--train-iters", "50", "--exit-duration-in-mins", "1e-5", "--save", save])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert f"> exiting at {unit} 1: --exit-duration-in-mins 1e-05 reached" in out, out[-3000:]
    assert latest_iteration(save) == 1
    if kind == "dmd2":
        assert latest_iteration(save + "_critic") == 1


def test_exit_controller_off_and_handler_restored():
    previous = signal.getsignal(signal.SIGTERM)
    off = ExitController(False, None, 0, torch.device("cpu"))
    assert not off.enabled and off.check() is None and signal.getsignal(signal.SIGTERM) is previous
    far = ExitController(False, 60.0, 0, torch.device("cpu"))
    assert far.enabled and far.check() is None
    on = ExitController(True, None, 0, torch.device("cpu"))
    assert signal.getsignal(signal.SIGTERM) == on._on_signal and on.check() is None
    os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the flag, does not kill pytest
    assert on.check() == "SIGTERM received (--exit-signal-handler)"
    on.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    late = ExitController(False, 1e-9, 1, torch.device("cpu"))  # not rank 0: its own clock does not count
    assert late.check() is None
