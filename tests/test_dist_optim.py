"""The distributed optimizer (`--use-distributed-optimizer`, dmd2_mega/train/dist_optim.py; issue 16, item 3).

  a. DP = 2 (torchrun, gloo; tests/mp_scripts/dist_optim_dp.py), against optim.Optimizer on the same model,
     weights and per-rank batches, 4 steps of 2 micro-batches, buckets of 40 elements (parameters straddle
     shards; buckets are padded):
       - fp32 without clipping and bf16 without clipping: the same maths, stepped on other layouts (flat
         fragments against whole tensors), so fused AdamW's vector body and scalar tail meet an element at other
         offsets: parameters within a few ulps after every step (see ULPS) on this CPU, and bit-equal in a second
         run under ATEN_CPU_CAPABILITY=default (scalar arithmetic, where the offsets cannot matter);
       - with clipping active: parameters within 2e-6 relative (the norm's summation order differs); the same
         with a clip group (a layer with optimizer settings of its own, `param_options`, clipped by its own norm);
       - optimizer state per rank (fp32 masters + Adam moments) at most half the plain optimizer's plus the
         padding;
       - state_dict after step 2 loaded into a fresh distributed optimizer: continues bit-equal to the
         uninterrupted run (the same optimizer on the same layout); into a plain one: within ULPS, and bit-equal
         under the default capability; loaded at DP = 1 (one rank, both ranks' batches): within fp32 rounding
         (the state is gathered into the plain optimizer's format, so it reshards).
  b. launch/pretrain_flow.py at DP = 2 with --use-distributed-optimizer: the same loss / grad-norm trace as DP = 1
     with the plain optimizer (1e-5 relative).
  c. DMD2 with the distributed optimizer for both trained roles (with TP, CP, DP and SP), equal to the world of one
     and resumed with the plain optimizer at another DP x CP: tests/test_token_parallel.py (which also checks the
     log line's phase times and TFLOP/s with `check_throughput_line` here).
"""
import json
import os

import pytest

from tests.test_parallel import TRAIN
from tests.utils import MP_SCRIPTS, PRETRAIN, assert_traces_close, launch, read_trace, run_parallel, torchrun

pytestmark = pytest.mark.timeout(400)
INTEGRATION_FIXTURES = ("runs",)  # fixtures that launch processes: their tests are marked integration

# The plain and the distributed optimizer differ only in where fused AdamW's vector / scalar split falls (FMA
# contraction and operation order of one update), i.e. <= 1 ulp of the parameter (or of the update, for a parameter
# near zero) per step; 4 steps, and moments differing by a few ulps feed the later updates at lr scale: 8 ulps of
# max(|p|, lr) in the parameter's dtype leaves room, and a wrong shard, offset or step is off by orders more
# (a skipped step moves a parameter by ~lr, 1e5 fp32 ulps of lr). A bf16 parameter is its fp32 master rounded,
# and a master differing by an fp32 ulp can round the other way: at most one bf16 ulp a step, so 8 as well.
ULPS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_optim")
    script = os.path.join(MP_SCRIPTS, "dist_optim_dp.py")
    jobs = {cap: (lambda cap=cap: torchrun(2, script, [str(d / f"{cap}.json")],
                                           extra_env={"ATEN_CPU_CAPABILITY": "default"} if cap == "default" else None
                                           ).check(f"distributed optimizer at DP=2 ({cap} CPU capability)"))
            for cap in ("native", "default")}
    run_parallel(jobs)
    return {cap: json.loads((d / f"{cap}.json").read_text()) for cap in jobs}


@pytest.fixture(scope="module")
def dp2(runs):
    """What this CPU's own vectorised kernels give."""
    return runs["native"]


def test_plain_and_distributed_steps_agree_to_ulps_without_clipping(dp2):
    assert dp2["fp32_exact"]["ulps"] <= ULPS, dp2["fp32_exact"]
    assert dp2["bf16_exact"]["ulps"] <= ULPS, dp2["bf16_exact"]
    assert dp2["fp32_exact"]["norm_rel"] <= 1e-6, dp2["fp32_exact"]


def test_bit_equal_to_plain_optimizer_under_scalar_arithmetic(runs):
    """ATEN_CPU_CAPABILITY=default: no vector body, so the two layouts run the same arithmetic per element."""
    d = runs["default"]
    assert d["fp32_exact"]["exact"], d["fp32_exact"]
    assert d["bf16_exact"]["exact"], d["bf16_exact"]
    assert d["resume"]["plain"], d["resume"]


def test_clipping_agrees_to_fp32_rounding(dp2):
    assert dp2["clip"]["max_rel"] <= 2e-6 and dp2["clip"]["norm_rel"] <= 1e-6, dp2["clip"]


def test_clip_groups_agree_to_fp32_rounding(dp2):
    """A layer clipped by its own norm (and its own lr / weight decay): each rank's fragments of it scaled by its
    group's coefficient, from squares all-reduced with the rest's."""
    c = dp2["clip_groups"]
    assert c["bites"] and c["max_rel"] <= 2e-6 and c["norm_rel"] <= 1e-6, c


def test_state_bytes_per_rank_halve(dp2):
    b = dp2["state_bytes"]
    padding = 4 * 2 * 12  # at most DP - 1 = 1 padded element per bucket (<= 4 buckets), 12 bytes each
    assert b["plain"] == 12 * b["params"], b  # bf16 model: fp32 master + two fp32 moments per parameter
    assert b["distributed"] <= b["plain"] / 2 + padding, b


def test_state_resumes_exactly_and_reshards(dp2):
    assert dp2["resume"]["distributed"], dp2["resume"]  # the same optimizer on the same layout: bit-exact
    assert dp2["resume_ulps"]["plain"] <= ULPS, dp2["resume_ulps"]  # another layout: see ULPS
    r = dp2["reshard"]
    assert r["max_abs"] <= 1e-6 * r["scale"], r


@pytest.mark.integration
def test_teacher_dp2_distributed_optimizer_equals_dp1(tmp_path):
    traces = {}
    for name, nproc, extra in (("ref", 1, []), ("zero", 2, ["--use-distributed-optimizer"])):
        launch(nproc, PRETRAIN, TRAIN + extra + ["--loss-trace", str(tmp_path / f"{name}.jsonl")]).check(name)
        traces[name] = read_trace(str(tmp_path / f"{name}.jsonl"))
    assert_traces_close(traces["zero"], traces["ref"], 1e-5, "flow DP=2 distributed optimizer vs DP=1")


def check_throughput_line(stdout: str, flops: float) -> None:
    """The DMD2 log line (throughput.py): the phases' times fit in the cycle's, and the model TFLOP/s per GPU is
    `flops` (one cycle's, per GPU) over the cycle's time."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(" iteration")]
    assert lines, stdout[-2000:]
    for ln in lines:
        field = {k.strip(): v.strip() for k, v in (p.split(": ") for p in ln.split("|")[1:-1])}
        ms = float(field["elapsed time per iteration (ms)"])
        phases = [float(field[f"{p}-ms"]) for p in ("rollout", "critic", "actor")]
        assert 0 < sum(phases) <= ms * 1.01, (phases, ms)
        assert float(field["model TFLOP/s per GPU"]) == pytest.approx(flops / ms / 1e9, rel=0.05 / ms + 5e-4)
