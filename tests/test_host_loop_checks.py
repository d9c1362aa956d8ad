"""The loop's exit check without a host sync per iteration (issue 51 item 4; `train/resilience.py`, `train/loop.py`).

The exit flags (a SIGTERM seen by --exit-signal-handler, the --exit-duration-in-mins deadline) are host values:
  one rank       `ExitController.poll()` decides after every iteration, on the host: a SIGTERM that comes during
                 iteration 3 stops the run after iteration 3, saved, whatever --log-interval is;
  several ranks  the ranks agree through a collective at the loop's check points only (multiples of --log-interval
                 or --save-interval, the last iteration): the same SIGTERM stops the run at the next check point,
                 saved there. Simulated in a world of one by making the controller see two ranks (its all-reduce
                 over the one real rank is then the identity).
Debug flow model (FlowTrainer shares the loop with the student trainer), in process.
"""
import os
import signal

import pytest

from dmd2_mega.arguments import parse_flow_args
from dmd2_mega.teacher_trainer import FlowTrainer
from dmd2_mega.train import resilience
from dmd2_mega.train.checkpoint import latest_iteration
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)

FLOW = ["--model-size", "debug", "--micro-batch-size", "8", "--lr", "3e-3", "--seed", "5", "--exit-signal-handler"]


def run_with_sigterm_in(iteration: int, flags: list, save: str, capsys) -> tuple[int, str]:
    """Train with a SIGTERM sent to this process while iteration `iteration` draws its batch; returns (the
    iteration the run stopped at, the output)."""
    with world_of_one():
        tr = FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "20", "--save", save] + flags))
        try:
            clean = tr.dataset.get_batch

            def get_batch(idx):
                if tr.iteration == iteration - 1 and not tr.exit.received:
                    os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the flag
                return clean(idx)
            tr.dataset.get_batch = get_batch
            tr.train()
        finally:
            tr.exit.close()
    return tr.iteration, capsys.readouterr().out


def test_one_rank_stops_after_the_iteration_of_the_signal(tmp_path, capsys):
    save = str(tmp_path / "ck")
    stopped, out = run_with_sigterm_in(3, ["--log-interval", "5"], save, capsys)
    assert stopped == 3 and "> exiting at iteration 3: SIGTERM received (--exit-signal-handler)" in out, out[-2000:]
    assert latest_iteration(save) == 3


@pytest.mark.parametrize("flags, at", [(["--log-interval", "5"], 5),
                                       (["--log-interval", "5", "--save-interval", "4"], 4)],
                         ids=["next-log-interval", "next-save-interval"])
def test_several_ranks_stop_at_the_next_check_point(flags, at, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(resilience, "_world_size", lambda: 2)  # poll() leaves the decision to the collective
    save = str(tmp_path / "ck")
    stopped, out = run_with_sigterm_in(3, flags, save, capsys)
    assert stopped == at and f"> exiting at iteration {at}: SIGTERM received" in out, out[-2000:]
    assert latest_iteration(save) == at and f"saved checkpoint at iteration {at}" in out
