"""--deterministic: two runs give bitwise-identical per-iteration loss traces on CPU.

For the flow trainer and for DMD2 (debug models, 4 iterations / cycles, --log-interval 1): one run
in this process and one in a subprocess with another PYTHONHASHSEED (a different process, different
set / dict-of-str orders, a fresh allocator), compared with == on every traced float (JSON
round-trips floats exactly). The traces must also move (losses differ between iterations), and the
in-process run must have switched torch's deterministic algorithms on.
"""
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import DMD2_TRACE_KEYS, PRETRAIN, PRETRAIN_DMD2, read_trace, run, world_of_one

pytestmark = pytest.mark.timeout(240)
INTEGRATION_FIXTURES = ("traces",)  # fixtures that launch processes: their tests are marked integration

FLOW = ["--model-size", "debug", "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3",
        "--log-interval", "1", "--seed", "9", "--train-iters", "4", "--deterministic"]


def dmd2_args(teacher: str) -> list:
    return ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4", "--lr", "1e-3",
            "--dmd2-critic-steps-per-rollout", "2", "--dmd2-teacher-guidance-scale", "2", "--log-interval", "1",
            "--seed", "3", "--train-iters", "4", "--deterministic", "--no-offload-inactive"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel_determinism")
    teacher = str(d / "teacher")
    try:
        with world_of_one():
            FlowTrainer(parse_flow_args(FLOW[:-3] + ["--train-iters", "10", "--save", teacher])).train()
        jobs = [[sys.executable, PRETRAIN] + FLOW + ["--loss-trace", d / "flow_sub.jsonl"],
                [sys.executable, PRETRAIN_DMD2] + dmd2_args(teacher) + ["--loss-trace", d / "dmd2_sub.jsonl"]]
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(run, c, 180, {"PYTHONHASHSEED": "12345"}) for c in jobs]
            with world_of_one():
                FlowTrainer(parse_flow_args(FLOW + ["--loss-trace", str(d / "flow_in.jsonl")])).train()
                enabled = torch.are_deterministic_algorithms_enabled()
            with world_of_one():
                DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--loss-trace", str(d / "dmd2_in.jsonl")])).train()
            for f in futs:
                f.result().check("deterministic run in a subprocess")
    finally:
        torch.use_deterministic_algorithms(False)
    return {"enabled": enabled, **{k: read_trace(d / f"{k}.jsonl") for k in
                                   ("flow_in", "flow_sub", "dmd2_in", "dmd2_sub")}}


def _identical(a: list, b: list, keys, what: str) -> None:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == [1, 2, 3, 4], what
    for ra, rb in zip(a, b):
        for k in keys:
            assert ra[k] == rb[k], f"{what}: iteration {ra['iteration']} {k}: {ra[k]!r} vs {rb[k]!r}"


def test_flow_deterministic_bitwise(traces):
    assert traces["enabled"], "--deterministic must switch torch's deterministic algorithms on"
    _identical(traces["flow_in"], traces["flow_sub"], ("loss", "grad_norm", "lr"), "flow --deterministic")
    assert len({r["loss"] for r in traces["flow_in"]}) == 4


def test_dmd2_deterministic_bitwise(traces):
    _identical(traces["dmd2_in"], traces["dmd2_sub"], DMD2_TRACE_KEYS, "DMD2 --deterministic")
    assert len({r["critic-loss"] for r in traces["dmd2_in"]}) == 4
