"""End-to-end DMD2 cycles through launch/pretrain_dmd2.py (debug DiT, CPU, gloo), and its flag checks.

Teacher: tests.utils.train_debug_teacher (10 flow-matching steps of the debug model, seed 5;
deterministic on one machine). Every DMD2 run: micro-batch B = 4, K = 2 critic steps per rollout,
lr 1e-3 for both roles (so the critic drifts off the teacher and the DMD signal is not ~0), teacher
CFG 2, log interval 1; the --loss-trace JSON lines hold one record per cycle with the keys
tests.utils.DMD2_TRACE_KEYS (critic-loss, critic-grad_norm, actor-dmd-loss, actor-grad_norm,
dmd-normaliser, dmd-fake-real-gap, dmd-grad-rms).

  a. TP=2 vs TP=1 and DP=2 vs DP=1, global batch 8 (DP=1: M = 2 micro-batches of 4 per rank; DP=2:
     M = 1 per rank, the same global micro indices, so the same rollout / critic noise): 5 cycles,
     every trace key within 1e-5 relative.
  b. --offload-inactive (roles sleep between phases; bit-exact wake) gives the SAME trace as
     --no-offload-inactive, with less resident memory in the critic and actor phases.
  c. <save>/ (student) and <save>_critic/ (critic) each hold Megatron's layout
     (latest_checkpointed_iteration.txt, iter_0000005/mp_rank_XX/model_optim_rng.pt, one file per
     TP rank), no *.tmp left; the two roles' weights differ from each other and from the teacher's.
  d. Resume: 6 cycles straight (the golden run below, saving every 3) = 3 cycles + save + --load + 3
     cycles: the same per-cycle trace (<= 1e-7 relative) and, at cycle 6, bit-identical student and
     critic weights and AdamW state (--lr-decay-iters 10 fixes the LR schedule across --train-iters).
  e. Golden: the 10-cycle trace of the straight run equals tests/golden/dmd2_debug_trace.json
     within 1e-4 relative. Regenerate (after an intended change of the numerics) with
         DMD2_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_dmd2_cycle.py -k golden
     A missing golden file FAILS the test.
  f. Flag validation (in-process, parse_dmd2_args / DMD2Config / TrainConfig.resolve_batches): each rejected
     combination raises ConfigError naming the flag.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.config import DMD2Config
from dmd2_mega.errors import ConfigError
from tests.utils import (DMD2_TRACE_KEYS, PRETRAIN_DMD2, REPO, assert_traces_close, find_tmp, launch, python,
                         read_trace)

pytestmark = pytest.mark.timeout(400)
INTEGRATION_FIXTURES = ("runs", "golden_runs",)  # fixtures that launch processes: their tests are marked integration

GOLDEN = os.path.join(REPO, "tests", "golden", "dmd2_debug_trace.json")
REGEN = os.environ.get("DMD2_REGEN_GOLDEN") == "1"


def common(teacher: str) -> list:
    return ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4",
            "--dmd2-critic-steps-per-rollout", "2", "--log-interval", "1", "--lr", "1e-3",
            "--dmd2-teacher-guidance-scale", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def teacher(debug_teacher):
    return debug_teacher


def _parallel(jobs: dict) -> dict:
    """Run {name: thunk} concurrently (each a subprocess launch); {name: Result}."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futs = {k: pool.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futs.items()}


# ---- a-c. TP / DP / offload / layout ----------------------------------------------------------

@pytest.fixture(scope="module")
def runs(teacher, tmp_path_factory):
    d = tmp_path_factory.mktemp("dmd2_runs")
    base = common(teacher) + ["--global-batch-size", "8", "--train-iters", "5"]

    def job(name, nproc, extra):
        args = base + extra + ["--save", str(d / name), "--loss-trace", str(d / f"{name}.jsonl")]
        return lambda: launch(nproc, PRETRAIN_DMD2, args, timeout=240)

    res = _parallel({"ref": job("ref", 1, ["--no-offload-inactive"]),
                     "offload": job("offload", 1, ["--offload-inactive"])})
    res["tp2"] = job("tp2", 2, ["--tensor-model-parallel-size", "2", "--no-offload-inactive"])()
    res["dp2"] = job("dp2", 2, ["--no-offload-inactive"])()
    return {k: {"result": r, "save": str(d / k), "trace": str(d / f"{k}.jsonl")} for k, r in res.items()}


def _ok(run: dict, what: str) -> dict:
    run["result"].check(what)
    return run


def test_tp2_trace_matches_tp1(runs):
    ref, tp2 = _ok(runs["ref"], "DMD2 TP=1"), _ok(runs["tp2"], "DMD2 TP=2")
    assert "TP=2 DP=1" in tp2["result"].stdout and "M=2" in tp2["result"].stdout
    a, b = read_trace(tp2["trace"]), read_trace(ref["trace"])
    assert [r["iteration"] for r in b] == [1, 2, 3, 4, 5]
    assert set(DMD2_TRACE_KEYS) <= set(b[0]), b[0]
    assert min(r["actor-dmd-loss"] for r in b) > 1e-5, "the DMD signal should be non-trivial"
    assert_traces_close(a, b, 1e-5, "DMD2 TP=2 vs TP=1", keys=DMD2_TRACE_KEYS)


def test_dp2_trace_matches_dp1(runs):
    ref, dp2 = _ok(runs["ref"], "DMD2 DP=1"), _ok(runs["dp2"], "DMD2 DP=2")
    assert "TP=1 DP=2" in dp2["result"].stdout and "M=1" in dp2["result"].stdout
    assert "TP=1 DP=1" in ref["result"].stdout and "M=2" in ref["result"].stdout
    assert_traces_close(read_trace(dp2["trace"]), read_trace(ref["trace"]), 1e-5, "DMD2 DP=2 vs DP=1",
                        keys=DMD2_TRACE_KEYS)


def _resident(stdout: str, phase: str) -> list:
    return [float(x) for x in re.findall(rf"resident-MB-{phase}: ([0-9.]+)", stdout)]


def test_offload_trace_identical(runs):
    ref, off = _ok(runs["ref"], "DMD2 --no-offload-inactive"), _ok(runs["offload"], "DMD2 --offload-inactive")
    assert "offload critic+student+teacher (--offload-inactive)" in off["result"].stdout
    assert "offload none (--no-offload-inactive)" in ref["result"].stdout
    a, b = read_trace(off["trace"]), read_trace(ref["trace"])
    assert len(a) == len(b) == 5
    for ra, rb in zip(a, b):
        assert ra == rb, f"offload changed the numerics at cycle {rb['iteration']}: {ra} vs {rb}"
    # after the first cycle every role has grads / optimizer state; asleep roles hold nothing
    for phase in ("critic", "actor"):
        on, no = _resident(off["result"].stdout, phase), _resident(ref["result"].stdout, phase)
        assert len(on) == len(no) == 5, (phase, on, no)
        assert on[-1] < 0.8 * no[-1], f"resident MB in the {phase} phase: {on[-1]} with offload vs {no[-1]} without"


def _payloads(root: str, it: int, tp: int) -> list:
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip() == str(it), root
    d = os.path.join(root, f"iter_{it:07d}")
    assert sorted(os.listdir(d)) == [f"mp_rank_{r:02d}" for r in range(tp)], os.listdir(d)
    files = [os.path.join(d, f"mp_rank_{r:02d}", "model_optim_rng.pt") for r in range(tp)]
    assert all(os.path.isfile(f) for f in files), files
    assert not find_tmp(root), find_tmp(root)
    return [torch.load(f, map_location="cpu", weights_only=False) for f in files]


@pytest.mark.parametrize("name,tp", [("ref", 1), ("tp2", 2)])
def test_student_and_critic_checkpoints_megatron_layout(runs, teacher, name, tp):
    run = _ok(runs[name], f"DMD2 {name}")
    student = _payloads(run["save"], 5, tp)
    critic = _payloads(run["save"] + "_critic", 5, tp)
    t = _payloads(teacher, 10, 1)[0]["model"]
    for rank, (s, c) in enumerate(zip(student, critic)):
        assert s["role"] == "student" and c["role"] == "critic"
        assert s["iteration"] == c["iteration"] == 5 and s["tp_size"] == c["tp_size"] == tp
        assert {"model", "optimizer", "scheduler", "sampler", "rng", "partition_dims"} <= s.keys() & c.keys()
        assert len(s["student_sigmas"]) == 4
    if tp == 1:  # every role moved: student != teacher, critic != teacher, student != critic
        def flat(m):
            return torch.cat([v.float().flatten() for k, v in sorted(m.items()) if isinstance(v, torch.Tensor)
                              and v.is_floating_point()])
        sw, cw, tw = flat(student[0]["model"]), flat(critic[0]["model"]), flat(t)
        assert sw.shape == cw.shape == tw.shape
        for what, x, y in (("student-teacher", sw, tw), ("critic-teacher", cw, tw), ("student-critic", sw, cw)):
            assert float((x - y).abs().max()) > 1e-4, f"{what}: the weights did not move apart"
    else:  # TP shards are halves, not copies
        for p in (student, critic):
            q0, q1 = p[0]["model"]["blocks.0.qkv.inner.weight"], p[1]["model"]["blocks.0.qkv.inner.weight"]
            assert q0.shape == (48, 32) and not torch.equal(q0, q1)


# ---- d-e. resume and golden -------------------------------------------------------------------

def golden_args(teacher: str) -> list:
    return common(teacher) + ["--lr-decay-iters", "10", "--lr-warmup-iters", "1"]


@pytest.fixture(scope="module")
def golden_runs(teacher, tmp_path_factory):
    d = tmp_path_factory.mktemp("dmd2_golden")
    straight, split = str(d / "straight"), str(d / "split")
    base = golden_args(teacher)
    res = _parallel({
        "straight": lambda: python(PRETRAIN_DMD2, base + ["--train-iters", "10", "--save", straight,
                                                          "--save-interval", "3", "--loss-trace", d / "straight.jsonl"],
                                   timeout=240),
        "split_a": lambda: python(PRETRAIN_DMD2, base + ["--train-iters", "3", "--save", split,
                                                         "--loss-trace", d / "split_a.jsonl"], timeout=240)})
    res["split_a"].check("DMD2 first 3 cycles")
    res["split_b"] = python(PRETRAIN_DMD2, base + ["--train-iters", "6", "--save", split, "--load", split,
                                                   "--loss-trace", d / "split_b.jsonl"], timeout=240)
    return {"d": d, "straight": straight, "split": split, "res": res}


def test_resume_reproduces_trace(golden_runs):
    g = golden_runs
    g["res"]["straight"].check("DMD2 10 straight cycles")
    out = g["res"]["split_b"].check("DMD2 resume for 3 more cycles").stdout
    assert "resumed student and critic from" in out and "at cycle 3" in out, out[-2000:]
    straight = read_trace(g["d"] / "straight.jsonl")
    split = read_trace(g["d"] / "split_a.jsonl") + read_trace(g["d"] / "split_b.jsonl")
    assert [r["iteration"] for r in split] == [1, 2, 3, 4, 5, 6]
    assert_traces_close(split, straight[:6], 1e-7, "DMD2 3 + resume + 3 vs 6 straight", keys=DMD2_TRACE_KEYS)
    assert len({r["critic-loss"] for r in straight}) == 10


def _adam(opt_state: dict) -> dict:
    return opt_state.get("inner", opt_state)["state"]


@pytest.mark.parametrize("suffix", ["", "_critic"])
def test_resume_reproduces_student_and_critic_state(golden_runs, suffix):
    g = golden_runs
    g["res"]["straight"].check("DMD2 10 straight cycles")
    g["res"]["split_b"].check("DMD2 resume")
    a = _payloads(g["split"] + suffix, 6, 1)[0]
    b = torch.load(os.path.join(g["straight"] + suffix, "iter_0000006", "mp_rank_00", "model_optim_rng.pt"),
                   map_location="cpu", weights_only=False)
    assert a["iteration"] == b["iteration"] == 6 and a["role"] == b["role"]
    for n, w in b["model"].items():
        if w is not None:
            assert torch.equal(a["model"][n], w), f"{b['role']} weight {n} differs after resume"
    sa, sb = _adam(a["optimizer"]), _adam(b["optimizer"])
    assert sa.keys() == sb.keys() and len(sb) > 0
    steps = 6 * (2 if suffix else 1)  # the critic steps K = 2 times per cycle, the student once
    for k in sb:
        assert float(sa[k]["step"]) == float(sb[k]["step"]) == steps
        for f in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][f], sb[k][f]), f"{b['role']} AdamW {f} of param {k} differs after resume"
    assert a["sampler"] == b["sampler"]


def _compare_golden(trace: list, golden: dict, rtol: float) -> None:
    assert [r["iteration"] for r in trace] == list(range(1, 11))
    assert_traces_close(trace, golden["trace"], rtol, "DMD2 debug trace vs tests/golden/dmd2_debug_trace.json",
                        keys=DMD2_TRACE_KEYS)


def test_golden_trace(golden_runs, teacher):
    g = golden_runs
    g["res"]["straight"].check("DMD2 10 straight cycles")
    trace = read_trace(g["d"] / "straight.jsonl")
    args = [a if a != teacher else "<teacher>" for a in golden_args(teacher)]
    if REGEN:
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            json.dump({"comment": "Per-cycle trace of 10 DMD2 cycles of the debug model (tests/test_dmd2_cycle.py). "
                                  "Regenerate: DMD2_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q "
                                  "tests/test_dmd2_cycle.py -k golden",
                       "teacher": "tests.utils.train_debug_teacher (10 steps, seed 5)",
                       "args": args + ["--train-iters", "10"], "trace": trace}, f, indent=1)
            f.write("\n")
        pytest.skip(f"DMD2_REGEN_GOLDEN=1: rewrote {GOLDEN}")
    assert os.path.isfile(GOLDEN), (f"golden trace {GOLDEN} is missing; create it with DMD2_REGEN_GOLDEN=1 "
                                    ".venv/bin/python -m pytest -q tests/test_dmd2_cycle.py -k golden")
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert golden["args"] == args + ["--train-iters", "10"], \
        "the golden run's flags changed; regenerate the golden file (see its comment)"
    _compare_golden(trace, golden, 1e-4)


# ---- f. flag validation -----------------------------------------------------------------------

BASE = ["--teacher-load", "ckpt/teacher"]


def test_defaults_parse():
    cfg = parse_dmd2_args(BASE + ["--lr", "2e-4", "--critic-adam-beta1", "0"])
    d = cfg.dmd2
    assert (d.critic_steps_per_rollout, d.score_sigma_range, d.critic_scoring, d.critic_loss_space,
            d.teacher_guidance_scale, d.denoising_steps) == (5, (0.02, 0.98), "shared", "velocity", 1.0, 4)
    c = cfg.critic_optim()
    assert c.lr == 2e-4 and c.adam_beta1 == 0.0 and c.adam_beta2 == cfg.optim.adam_beta2
    assert parse_dmd2_args(BASE + ["--critic-lr", "5e-5"]).critic_optim().lr == 5e-5
    cfg = parse_dmd2_args(BASE + ["--adam-eps", "1e-6", "--clip-grad", "0.5", "--lr-warmup-iters", "3",
                                  "--override-opt-param-scheduler", "--load", "ckpt/student",
                                  "--critic-weight-decay", "0.1"])
    c = asdict(cfg.critic_optim())  # every field but the --critic-* overrides is the student's
    assert c == {**asdict(cfg.optim), "weight_decay": 0.1}, c
    assert parse_dmd2_args(BASE + ["--micro-batch-size", "4", "--global-batch-size", "16"]).train.resolve_batches(2) == 2


@pytest.mark.parametrize("argv,message", [
    ([], "--teacher-load is required"),
    (BASE + ["--dmd2-teacher-guidance-scale", "0.5"], "--dmd2-teacher-guidance-scale must be >= 1"),
    (BASE + ["--dmd2-score-sigma-range", "0.5", "0.5"], "--dmd2-score-sigma-range needs 0 <= MIN < MAX <= 1"),
    (BASE + ["--dmd2-score-sigma-range", "0.6", "0.3"], "--dmd2-score-sigma-range needs 0 <= MIN < MAX <= 1"),
    (BASE + ["--dmd2-score-sigma-range", "-0.1", "0.5"], "--dmd2-score-sigma-range needs 0 <= MIN < MAX <= 1"),
    (BASE + ["--dmd2-score-sigma-range", "0.2", "1.5"], "--dmd2-score-sigma-range needs 0 <= MIN < MAX <= 1"),
    (BASE + ["--dmd2-critic-grid-size", "2", "--dmd2-score-sigma-range", "0.6", "0.9"], "holds no point"),
    (BASE + ["--dmd2-critic-steps-per-rollout", "0"], "--dmd2-critic-steps-per-rollout must be >= 1"),
    (BASE + ["--dmd2-critic-scoring", "fused"], "--dmd2-critic-scoring must be shared or original"),
    (BASE + ["--dmd2-critic-loss-space", "eps"], "--dmd2-critic-loss-space must be velocity or x0"),
    (BASE + ["--dmd2-denoising-steps", "0"], "--dmd2-denoising-steps must be an int >= 1"),
    (BASE + ["--dmd2-student-sigmas", "0.9", "0.5"], "--dmd2-student-sigmas must start at 1.0"),
    (BASE + ["--dmd2-student-sigmas", "1.0", "0.5", "0.75"], "--dmd2-student-sigmas must be strictly decreasing"),
    (BASE + ["--dmd2-student-sigmas", "1.0", "0.5", "0.5"], "--dmd2-student-sigmas must be strictly decreasing"),
], ids=["no-teacher", "guidance<1", "min=max", "min>max", "min<0", "max>1", "no-grid-point", "K<1",
        "scoring", "loss-space", "N<1", "sigmas-start", "sigmas-increasing", "sigmas-repeated"])
def test_rejected_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_dmd2_args(argv)
    assert message in str(e.value), str(e.value)


def test_score_range_checked_in_dmd2config():
    with pytest.raises(ConfigError, match="MIN < MAX"):
        DMD2Config(teacher_load="t", score_sigma_range=(0.7, 0.2))


@pytest.mark.parametrize("micro,global_,dp", [(4, 6, 1), (4, 12, 2), (4, 4, 2)])
def test_global_batch_must_be_multiple_of_micro_times_dp(micro, global_, dp):
    cfg = parse_dmd2_args(BASE + ["--micro-batch-size", str(micro), "--global-batch-size", str(global_)])
    with pytest.raises(ConfigError) as e:
        cfg.train.resolve_batches(dp)
    msg = str(e.value)
    assert f"--global-batch-size ({global_}) must be a multiple of --micro-batch-size x data-parallel size" in msg
    assert f"({micro} x {dp} = {micro * dp})" in msg, msg


@pytest.mark.integration
def test_a_checkpoint_of_the_previous_tree_resumes(tmp_path):
    """tests/golden/dmd2_ckpt_main: the teacher (weights only) and the student / critic pair at cycle 3 of the
    golden run, written by main before issue 28 moved the package's modules (commit 4718609). This tree resumes
    the pair and its cycles 4-6 are the golden trace's."""
    shutil.copytree(os.path.join(os.path.dirname(GOLDEN), "dmd2_ckpt_main"), tmp_path / "old")
    old = tmp_path / "old"
    args = [str(old / "teacher") if a == "<teacher>" else a for a in json.load(open(GOLDEN))["args"][:-2]]
    out = python(PRETRAIN_DMD2, args + ["--train-iters", "6", "--load", old / "student", "--save", tmp_path / "new",
                                        "--loss-trace", tmp_path / "new.jsonl"], timeout=240).check("resume").stdout
    assert f"resumed student and critic from {old / 'student'} at cycle 3" in out, out[-2000:]
    assert_traces_close(read_trace(tmp_path / "new.jsonl"), json.load(open(GOLDEN))["trace"][3:6], 1e-4,
                        "DMD2 resumed from the previous tree's checkpoint vs the golden trace", keys=DMD2_TRACE_KEYS)
