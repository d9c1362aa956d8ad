"""--bf16 DMD2: bf16 roles with fp32 masters run the cycle and track the fp32 trace closely."""
import pytest

from tests.utils import PRETRAIN_DMD2, python, read_trace, train_debug_teacher

pytestmark = pytest.mark.timeout(300)


def test_bf16_dmd2_runs_and_tracks_fp32(tmp_path):
    teacher = train_debug_teacher(str(tmp_path / "teacher"))
    traces = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        trace = tmp_path / f"{name}.jsonl"
        python(PRETRAIN_DMD2, ["--model-size", "debug", "--teacher-load", teacher, "--train-iters", "3",
                               "--micro-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2",
                               "--dmd2-teacher-guidance-scale", "1.5", "--log-interval", "1",
                               "--offload-inactive", "--loss-trace", str(trace), *extra]).check(f"{name} DMD2")
        traces[name] = read_trace(str(trace))
    assert len(traces["bf16"]) == 3
    for a, b in zip(traces["fp32"], traces["bf16"]):
        # bf16 rounding (8 bits of mantissa) moves the losses by well under 5%, never to NaN
        assert b["critic-loss"] == pytest.approx(a["critic-loss"], rel=5e-2)
