"""Context parallelism (`--context-parallel-size`) and sequence parallelism (`--sequence-parallel`) on the Wan
family (dmd2_mega/models/token_parallel.py; issue 16, items 1-2).

  a. One forward + backward of a 4-head Wan on a 3 x 3 x 5 token grid (45 tokens: odd, and 3 frames, so neither
     is a multiple of CP = 2; tests/mp_scripts/wan_token_parallel.py), the loss reading the output and the GAN
     head's token-grid features, gradients reduced by the run's GradBuffer, against the world of one (fp32):
       - CP = 2 (2 ranks): output, features and every gradient within 1e-5 relative;
       - TP = 2 with --sequence-parallel equals TP = 2 without it (1e-5);
       - TP = 2 x CP = 2 with SP and recompute (4 ranks) equals TP = 1.
  b. The split's arithmetic: padding to a multiple of CP (x TP under SP), each rank's tokens, the rotary rows of
     a CP chunk, and the identity in a world of one.
  c. Bad layouts are one-line errors naming the flags.
  d. launch/pretrain_dmd2.py on a converted tiny diffusers Wan (4 heads, 27 tokens) with TP = 2 x CP = 2 x DP = 2,
     SP, the distributed optimizer, time-slicing, the GAN head and EMA (8 ranks) equals the world of one, cycle
     by cycle (1e-5 per trace key); its log lines' phase times fit the cycle and their TFLOP/s per GPU is the
     cycle's FLOPs over its time. CP does not change the weights: its cycle-2 checkpoint resumes at TP = 2 x
     CP = 1 and the world of one's resumes at CP = 2 (a TP change reshards weights but not optimizer state),
     both continuing the uninterrupted trace. launch/pretrain_flow.py at CP = 2 equals CP = 1.
"""
import os
import shutil

import pytest
import torch

from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.train.builders import data_info
from dmd2_mega.config import ParallelConfig
from dmd2_mega.data import build_dataset
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import BuildOptions, DataShape, build_model, get_spec
from dmd2_mega.models.token_parallel import TokenSplit
from tests.test_dist_optim import check_throughput_line
from tests.utils import (DMD2_TRACE_KEYS, MP_SCRIPTS, PRETRAIN, PRETRAIN_DMD2, assert_traces_close,
                         converted_wan_teacher, launch, python, read_trace, torchrun)

pytestmark = pytest.mark.timeout(600)
INTEGRATION_FIXTURES = ("fb", "wan4",)  # fixtures that launch processes: their tests are marked integration
SCRIPT = os.path.join(MP_SCRIPTS, "wan_token_parallel.py")
KEYS = DMD2_TRACE_KEYS + ("gan-disc-loss", "actor-gan-loss")


# ---- a. the model under CP / SP ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fb(tmp_path_factory):
    """name -> saved output, features, loss and gradients; "ref" is TP = CP = 1 (the world of one's maths)."""
    d = tmp_path_factory.mktemp("token_parallel")
    torchrun(2, SCRIPT, ["--out", d, "ref:1:1:0:0", "cp2:1:2:0:0", "tp2:2:1:0:0", "tp2sp:2:1:1:0"]).check("2 ranks")
    torchrun(4, SCRIPT, ["--out", d, "all:2:2:1:1"]).check("4 ranks")
    return {name: torch.load(d / f"{name}.pt") for name in ("ref", "cp2", "tp2", "tp2sp", "all")}


def assert_same(got: dict, want: dict, rtol: float, what: str) -> None:
    for key in ("out", "feats", "loss"):
        err = float((got[key] - want[key]).abs().max())
        assert err <= rtol * float(want[key].abs().max()), f"{what}: {key} differs by {err:.3e}"
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        assert float(g.abs().max()) > 0, f"{name} has no gradient: the test would not see a wrong one"
        err = float((got["grads"][name] - g).abs().max())
        assert err <= rtol * float(g.abs().max()), f"{what}: gradient of {name} differs by {err:.3e}"


def test_cp2_equals_cp1(fb):
    assert_same(fb["cp2"], fb["ref"], 1e-5, "CP=2 vs CP=1")


def test_sequence_parallel_equals_tp2_without_it(fb):
    assert_same(fb["tp2sp"], fb["tp2"], 1e-5, "TP=2 SP vs TP=2")


def test_tp2_cp2_sp_recompute_equals_tp1(fb):
    assert_same(fb["all"], fb["ref"], 1e-5, "TP=2 x CP=2 SP recompute vs TP=1")


# ---- b. the split's arithmetic ----------------------------------------------------------------------------

def test_padding_and_shards():
    s = TokenSplit(45, cp=2, cp_rank=1, sp=2, sp_rank=1)
    assert (s.padded, s.cp_tokens, s.local_tokens) == (48, 24, 12)
    t = torch.arange(45.0)[None, :, None]
    assert s.shard(t).flatten().tolist() == list(range(36, 45)) + [0.0] * 3  # the last rank holds the padding
    rows = s.cp_rows(torch.arange(45.0)[:, None]).flatten()
    assert rows.tolist() == list(range(24, 45)) + [44.0] * 3  # CP chunk 1, padded with the last row
    whole = [TokenSplit(45, 2, c, 2, r).shard(t).flatten() for c in range(2) for r in range(2)]
    assert torch.cat(whole)[:45].tolist() == list(range(45))


def test_world_of_one_is_the_identity():
    s, t = TokenSplit(45), torch.randn(2, 45, 8)
    assert s.shard(t) is t and s.gather(t) is t and s.attention_heads(t) is t and s.enter_sp(t) is t


# ---- c. errors --------------------------------------------------------------------------------------------

def test_bad_layouts_are_clear_errors():
    shape = DataShape(4, (1, 2, 2), cond_shape=(3, 16))
    with pytest.raises(ConfigError, match="--context-parallel-size 2 must divide the number of attention heads"):
        build_model("wan-debug", shape, tp_size=2, options=BuildOptions(context_parallel=2))  # 2 heads
    with pytest.raises(ConfigError, match="built for the Wan family"):
        build_model("debug", DataShape(1, 8, num_classes=10), options=BuildOptions(context_parallel=2))
    with pytest.raises(ConfigError, match="--sequence-parallel runs with --transformer-impl local"):
        build_model("wan-debug", shape, options=BuildOptions(transformer_impl="transformer_engine",
                                                             sequence_parallel=True))
    with pytest.raises(ConfigError, match="needs --tensor-model-parallel-size > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match="--context-parallel-size must be >= 1"):
        ParallelConfig(context_parallel_size=0)
    assert get_spec("wan-debug").num_heads == 2


@pytest.mark.integration
def test_world_not_divisible_names_both_flags():
    r = python(PRETRAIN, ["--model-size", "debug", "--train-iters", "1", "--tensor-model-parallel-size", "2",
                          "--context-parallel-size", "2"])
    assert r.returncode != 0
    assert "--tensor-model-parallel-size 2 x --context-parallel-size 2 does not divide the world size 1" in \
        r.stdout + r.stderr, r.tail()


# ---- d. DMD2 and the teacher trainer end to end -----------------------------------------------------------

@pytest.fixture(scope="module")
def wan4(tmp_path_factory):
    """(converted teacher, data): a tiny random diffusers Wan with 4 heads of 6; latents [4, 3, 6, 6] (27 tokens)."""
    return converted_wan_teacher(str(tmp_path_factory.mktemp("wan4")), num_attention_heads=4, attention_head_dim=6,
                                 latent=(4, 3, 6, 6))


def dmd2_args(teacher, data, out, iters):
    return ["--model-size", teacher, "--teacher-load", teacher, "--data", data, "--micro-batch-size", "2",
            "--global-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2", "--train-iters", str(iters),
            "--log-interval", "1", "--lr", "1e-3", "--lr-decay-iters", "4", "--dmd2-teacher-guidance-scale", "3",
            "--seed", "3", "--dmd2-gan", "--ema-decay", "0.9", "--save-interval", "2", "--save", out,
            "--loss-trace", out + ".jsonl"]


@pytest.mark.integration
def test_dmd2_everything_on_equals_world_of_one_and_cp_checkpoints_move(wan4, tmp_path):
    teacher, data = wan4
    d = str(tmp_path)
    python(PRETRAIN_DMD2, dmd2_args(teacher, data, f"{d}/ref", 3), timeout=300).check("world of one")
    ref = read_trace(f"{d}/ref.jsonl")
    everything = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel",
                  "--use-distributed-optimizer", "--offload-inactive"]  # time-sliced too (on CPU only if asked)
    res = torchrun(8, PRETRAIN_DMD2, dmd2_args(teacher, data, f"{d}/all", 2) + everything, timeout=400)
    assert "TP=2 CP=2 DP=2 SP" in res.check("TP2 x CP2 x DP2 SP dist-opt").stdout, res.tail()
    # one cycle per GPU: B=2, K=2 (rollout K(N+1)/2 = 5, critic 3K = 6), CFG 3 (2 teacher forwards), actor 3, in
    # forwards of one sample at TP=2, its tokens split over CP=2 (the GAN head's forwards are not counted)
    per_sample = mp.forward_flops(mp.model_shape_from_info(teacher, data_info(build_dataset(data))), 1, 2) / 2
    check_throughput_line(res.stdout, (5 + 6 + 2 + 3) * 2 * per_sample)
    assert_traces_close(read_trace(f"{d}/all.jsonl"), ref[:2], 1e-5, "TP2 x CP2 x DP2 + SP + dist-opt vs one", KEYS)

    def resume(src: str, name: str, nproc: int, extra=()):
        for suffix in ("", "_critic"):  # cycle 2's student and critic
            shutil.copytree(f"{d}/{src}{suffix}/iter_0000002", f"{d}/{name}{suffix}/iter_0000002")
            with open(f"{d}/{name}{suffix}/latest_checkpointed_iteration.txt", "w") as f:
                f.write("2")
        launch(nproc, PRETRAIN_DMD2, dmd2_args(teacher, data, f"{d}/{name}", 3) + ["--load", f"{d}/{name}", *extra],
               timeout=300).check(name)
        trace = read_trace(f"{d}/{name}.jsonl")
        assert [r["iteration"] for r in trace] == [3], trace
        assert_traces_close(trace, ref[2:], 1e-5, f"{name}: cycle 3 after the resume vs uninterrupted", KEYS)

    resume("all", "cp2_to_cp1", 2, ["--tensor-model-parallel-size", "2"])  # TP kept: optimizer state stays
    resume("ref", "cp1_to_cp2", 2, ["--context-parallel-size", "2"])


@pytest.mark.integration
def test_teacher_trainer_cp2_equals_cp1(wan4, tmp_path):
    teacher, data = wan4
    base = ["--model-size", teacher, "--data", data, "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--log-interval", "1", "--lr", "1e-3", "--seed", "5"]
    traces = {}
    for name, n, extra in (("cp1", 1, []), ("cp2", 2, ["--context-parallel-size", "2"])):
        launch(n, PRETRAIN, base + extra + ["--loss-trace", str(tmp_path / f"{name}.jsonl")]).check(name)
        traces[name] = read_trace(str(tmp_path / f"{name}.jsonl"))
    assert len(traces["cp1"]) == 3
    assert_traces_close(traces["cp2"], traces["cp1"], 1e-5, "pretrain_flow CP=2 vs CP=1")
