"""`--cuda-graphs` (models/cuda_graphs.py): the choice, the routing of a role's forward, and a DMD2 cycle whose model
calls replay as graphs would (each output overwritten in place when its signature runs again: `EmulatedCapture`)
equal to the eager cycle, bit for bit. On a GPU the last test captures for real and compares with eager.

The precondition of capture (no host sync, no new shapes after warm-up) is tests/test_host_syncs.py's.
"""
import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.models import cuda_graphs
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_counts():
    cuda_graphs.reset()
    yield
    cuda_graphs.reset()


def test_choice_off_unless_asked_and_refused_where_no_graph_can_capture():
    assert cuda_graphs.choose(False, torch.device("cpu"))[0] is False
    assert cuda_graphs.choose(True, CUDA) == (True, cuda_graphs.choose(True, CUDA)[1])
    with pytest.raises(ConfigError, match="--cuda-graphs needs CUDA"):
        cuda_graphs.choose(True, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"offload \(critic, teacher\).*--no-offload-inactive"):
        cuda_graphs.choose(True, CUDA, offload={"teacher", "critic"})
    for layout in (dict(tp=2), dict(cp=2), dict(sp=True)):
        with pytest.raises(ConfigError, match="--cuda-graphs: TP, CP or sequence parallelism > 1"):
            cuda_graphs.choose(True, CUDA, **layout)


def test_the_cpu_run_refuses_the_flag_in_one_line(debug_teacher):
    with world_of_one(), pytest.raises(ConfigError, match="--cuda-graphs needs CUDA"):
        trainer(debug_teacher, "--cuda-graphs")


class Recording:
    """A capture that records what it was asked to capture and runs eager."""

    def __init__(self):
        self.asked = []

    def plain(self, fn, args):
        self.asked.append(("plain", tuple(a.shape[0] for a in args)))
        return fn

    def with_grad(self, module, args):
        self.asked.append(("grad", tuple(a.shape[0] for a in args)))
        return module


def test_calls_route_to_one_graph_per_signature_inside_a_cycle_only():
    model = torch.nn.Linear(3, 2)
    rec = Recording()
    cuda_graphs.install({"student": model, "same": model}, rec)  # one model under two roles: routed once
    x = torch.randn(4, 3)
    model(x)  # outside `capturing`: eager, nothing captured
    assert rec.asked == []
    with cuda_graphs.capturing():
        with torch.no_grad():
            model(x), model(x), model(x[:2])
        model(x)
        model(input=x)  # a keyword call: eager
    assert rec.asked == [("plain", (4,)), ("plain", (2,)), ("grad", (4,))]
    assert cuda_graphs.CAPTURED == {("student", False): 2, ("student", True): 1}
    cuda_graphs.seal()
    with cuda_graphs.capturing(), torch.no_grad():
        model(x[:3])
    assert cuda_graphs.take_new() == ["student 3 rows, no grad"]
    cuda_graphs.uninstall([model])
    assert "forward" not in model.__dict__


def test_the_emulation_catches_an_output_kept_across_a_second_call():
    """What makes the cycle test below able to fail: a caller that keeps a graph's output past the next call of its
    signature reads the new values."""
    model = torch.nn.Linear(3, 2)
    cuda_graphs.install({"student": model}, cuda_graphs.EmulatedCapture())
    a_in, b_in = torch.randn(4, 3), torch.randn(4, 3)
    with torch.no_grad():
        want = model(a_in).clone()
        with cuda_graphs.capturing():
            a = model(a_in)
            model(b_in)
    assert not torch.equal(a, want) and torch.equal(a, model(b_in))


def trainer(teacher: str, *extra) -> DMD2Trainer:
    return DMD2Trainer(parse_dmd2_args([
        "--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "2", "--global-batch-size", "4",
        "--dmd2-critic-steps-per-rollout", "2", "--train-iters", "3", "--dmd2-teacher-guidance-scale", "2",
        "--ema-decay", "0.5", "--no-offload-inactive", *extra]))


def state(tr: DMD2Trainer) -> list:
    return [p.detach().clone() for name in ("student", "critic") for p in tr.roles[name].model.parameters()]


def eager_and_emulated(build) -> dict:
    """{graphed: (the metrics of two cycles, the trained weights)} of a trainer from `build()` run eager and with every
    model call replayed as a graph would (EmulatedCapture), each in a world of one."""
    runs = {}
    for graphed in (False, True):
        with world_of_one():
            tr = build(graphed)
            if graphed:
                cuda_graphs.install({name: r.model for name, r in tr.roles.items()}, cuda_graphs.EmulatedCapture())
                tr.graphs = True
            outs = [tr.cycle()["metrics"] for _ in range(2)]
            runs[graphed] = ([{k: v.clone() for k, v in o.items()} for o in outs], state(tr))
            cuda_graphs.uninstall(r.model for r in tr.roles.values())
    (m_eager, w_eager), (m_graph, w_graph) = runs[False], runs[True]
    for a, b in zip(m_eager, m_graph):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert all(torch.equal(a, b) for a, b in zip(w_eager, w_graph))
    return runs


@pytest.mark.parametrize("scoring", ["shared", "original"])
def test_a_cycle_with_graph_semantics_equals_eager(debug_teacher, scoring):
    """Two cycles with every model call replayed as a graph would (EmulatedCapture) against the same two eager:
    the metrics and the trained weights bit-equal; the student, critic and teacher each captured."""
    eager_and_emulated(lambda graphed: trainer(debug_teacher, "--dmd2-critic-scoring", scoring))
    roles = {role for role, _ in cuda_graphs.CAPTURED}
    assert roles == {"student", "critic", "teacher"}, cuda_graphs.CAPTURED
    assert cuda_graphs.CAPTURED[("critic", True)] == 1 and cuda_graphs.CAPTURED[("student", True)] == 1
    assert cuda_graphs.CAPTURED[("critic", False)] == (1 if scoring == "original" else 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a GPU")
def test_captured_cycles_equal_eager_on_a_gpu(debug_teacher):
    """Real capture: three cycles with --cuda-graphs against three eager, fp32 (same kernels replayed: equal to
    within the reduction-order noise of cuBLAS's choice per capture)."""
    runs = {}
    for extra in ((), ("--cuda-graphs",)):
        with world_of_one():
            tr = trainer(debug_teacher, "--no-compile", *extra)
            outs = [tr.cycle()["metrics"] for _ in range(3)]
            torch.cuda.synchronize()
            runs[bool(extra)] = ([{k: v.double().cpu() for k, v in o.items()} for o in outs],
                                 [w.double().cpu() for w in state(tr)])
            cuda_graphs.uninstall(r.model for r in tr.roles.values())
    for a, b in zip(runs[False][0], runs[True][0]):
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(runs[False][1], runs[True][1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert sum(cuda_graphs.CAPTURED.values()) >= 4


def test_a_self_forcing_cycle_with_graph_semantics_equals_eager(tmp_path):
    """The same for Self-Forcing: its causal student's streaming passes (`stream_forward`) stay eager, its critic's
    and teacher's calls (and any plain forward of the student) replay."""
    from benchmarks import bench_self_forcing_cycle
    a = bench_self_forcing_cycle.parse_args(["--data", "moving-digits", "--micro-batch-size", "1",
                                             "--dmd2-critic-steps-per-rollout", "2"])
    eager_and_emulated(lambda graphed: bench_self_forcing_cycle.Harness(a, str(tmp_path / str(graphed))).tr)
    assert {"critic", "teacher"} <= {role for role, _ in cuda_graphs.CAPTURED}, cuda_graphs.CAPTURED
