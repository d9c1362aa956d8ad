"""Tensor and data parallelism on CPU (gloo, torchrun): TP=2 and DP=2 must reproduce TP=1/DP=1.

References, all from a world of one:
  a. One forward + backward of the debug DiT (tests/mp_scripts/tp_forward_backward.py): at TP=2
     every sharded parameter and gradient, all-gathered along its partition dim, must equal the
     TP=1 tensor: initial weights exactly (CPU init of the full master matrix, then sliced),
     output [6, 1, 8, 8] and gradients to fp32 round-off (max |a - b| <= 1e-5 * max |b|).
  b. Loss / grad-norm / lr trace of 5 optimizer steps of launch/pretrain_flow.py at TP=2 vs TP=1,
     global batch 16 = micro 8 x 2 micro-batches: relative difference <= 1e-5 per iteration.
  c. DP=2 (micro 8, one micro-batch per rank) vs DP=1 (micro 8, two micro-batches): the same global
     batch with the same per-micro-batch noise (keyed by the global micro index), so the same trace.
  d. Both write Megatron's layout: <save>/latest_checkpointed_iteration.txt and
     iter_0000005/mp_rank_00[/mp_rank_01 at TP=2]/model_optim_rng.pt, no *.tmp left.
  e. launch/sample.py reshards a TP=2 checkpoint to TP=1; its samples equal sampling at TP=2;
     resuming the optimizer of a TP=2 checkpoint at TP=1 fails naming both degrees.
"""
import os

import numpy as np
import pytest
import torch

from tests.utils import (MP_SCRIPTS, PRETRAIN, SAMPLE, assert_traces_close, find_tmp, launch, python,
                         read_trace, run_parallel, torchrun)

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("forward_backward", "runs", "samples",)  # fixtures that launch processes: their tests are marked integration

FB_SCRIPT = os.path.join(MP_SCRIPTS, "tp_forward_backward.py")
ITERS = 5
TRAIN = ["--model-size", "debug", "--train-iters", str(ITERS), "--micro-batch-size", "8",
         "--global-batch-size", "16", "--log-interval", "2", "--lr", "3e-3", "--lr-warmup-iters", "1",
         "--seed", "7"]
N_PARAMS_DEBUG = 42692  # DiT debug at 1x8x8, 10 classes; see test_model.test_count_parameters


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-30)


# ---- a. one forward + backward ---------------------------------------------------------------

@pytest.fixture(scope="module")
def forward_backward(tmp_path_factory):
    d = tmp_path_factory.mktemp("fb")
    python(FB_SCRIPT, ["--tp", "1", "--out", d / "tp1.pt"]).check("TP=1 forward/backward")
    torchrun(2, FB_SCRIPT, ["--tp", "2", "--out", d / "tp2.pt"]).check("TP=2 forward/backward")
    return torch.load(d / "tp1.pt"), torch.load(d / "tp2.pt")


def test_tp2_initial_weights_equal_tp1_exactly(forward_backward):
    ref, tp2 = forward_backward
    assert tp2["tp"] == 2 and ref["tp"] == 1
    assert ref["init"].keys() == tp2["init"].keys()
    sharded = [n for n, d in tp2["partition_dims"].items() if d is not None]
    assert len(sharded) >= 10, f"expected the block linears to be TP-sharded, got {sharded}"
    for n, w in ref["init"].items():
        assert tp2["init"][n].shape == w.shape, n
        assert torch.equal(tp2["init"][n], w), f"{n}: initial weight differs at TP=2"
        assert torch.equal(tp2["weights"][n], ref["weights"][n]), f"{n}: perturbed weight differs at TP=2"


def test_tp2_forward_and_grads_match_tp1(forward_backward):
    ref, tp2 = forward_backward
    assert float(ref["output"].abs().max()) > 1e-2, "perturbed model should give a non-trivial output"
    assert rel_err(tp2["output"], ref["output"]) <= 1e-5, \
        f"output differs: rel {rel_err(tp2['output'], ref['output']):.2e}"
    assert abs(float(tp2["loss"]) - float(ref["loss"])) <= 1e-5 * abs(float(ref["loss"]))
    nonzero = 0
    for n, g in ref["grads"].items():
        assert g.abs().max() < float("inf")
        nonzero += int(g.abs().max() > 0)
        assert rel_err(tp2["grads"][n], g) <= 1e-5, f"grad of {n} differs: rel {rel_err(tp2['grads'][n], g):.2e}"
    assert nonzero == len(ref["grads"]), "every parameter should receive gradient in the perturbed model"


def test_tp2_replicas_agree_and_parameter_count(forward_backward):
    ref, tp2 = forward_backward
    bad = {n: v for n, v in tp2["replica_spread"].items() if v > 1e-6}
    assert not bad, f"replicated parameters / grads / output differ across TP ranks: {bad}"
    assert ref["count"] == tp2["count"] == N_PARAMS_DEBUG


# ---- b-e. end-to-end training / checkpoints / sampling ----------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train the same 5 steps at TP=1 DP=1, TP=2 DP=1 and TP=1 DP=2."""
    d = tmp_path_factory.mktemp("train")
    jobs = {name: (lambda nproc=nproc, name=name, extra=extra: launch(
        nproc, PRETRAIN, TRAIN + extra + ["--save", d / name, "--loss-trace", d / f"{name}.jsonl"]))
        for name, nproc, extra in (("ref", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"]), ("dp2", 2, []))}
    return {name: {"result": res, "save": str(d / name), "trace": str(d / f"{name}.jsonl")}
            for name, res in run_parallel(jobs).items()}


def _checked(run: dict, what: str) -> dict:
    run["result"].check(what)
    return run


def test_tp2_loss_trace_matches_tp1(runs):
    ref, tp2 = _checked(runs["ref"], "TP=1 training"), _checked(runs["tp2"], "TP=2 training")
    assert "TP=2 DP=1" in tp2["result"].stdout
    a, b = read_trace(tp2["trace"]), read_trace(ref["trace"])
    assert [r["iteration"] for r in b] == list(range(1, ITERS + 1))
    assert_traces_close(a, b, 1e-5, "TP=2 vs TP=1")


def test_dp2_loss_trace_matches_dp1(runs):
    ref, dp2 = _checked(runs["ref"], "DP=1 training"), _checked(runs["dp2"], "DP=2 training")
    assert "TP=1 DP=2" in dp2["result"].stdout and "x 1 micro-batches" in dp2["result"].stdout
    assert "x 2 micro-batches" in ref["result"].stdout
    assert_traces_close(read_trace(dp2["trace"]), read_trace(ref["trace"]), 1e-5, "DP=2 vs DP=1")


def _layout(save: str, tp: int) -> list:
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(ITERS)
    it = os.path.join(save, f"iter_{ITERS:07d}")
    assert sorted(os.listdir(it)) == [f"mp_rank_{r:02d}" for r in range(tp)], os.listdir(it)
    files = [os.path.join(it, f"mp_rank_{r:02d}", "model_optim_rng.pt") for r in range(tp)]
    for f in files:
        assert os.path.isfile(f), f
    assert not find_tmp(save), find_tmp(save)
    return [torch.load(f, map_location="cpu", weights_only=False) for f in files]


def _full_model(payloads: list) -> dict:
    dims, out = payloads[0]["partition_dims"], {}
    for n in dims:
        d = dims[n]
        out[n] = payloads[0]["model"][n] if d is None else torch.cat([p["model"][n] for p in payloads], dim=d)
    return out


@pytest.mark.parametrize("name,tp", [("tp2", 2), ("dp2", 1)])
def test_megatron_layout_and_final_weights(runs, name, tp):
    ref = _layout(_checked(runs["ref"], "TP=1 DP=1 training")["save"], 1)
    other = _layout(_checked(runs[name], f"{name} training")["save"], tp)
    assert [p["tp_size"] for p in other] == [tp] * tp and [p["dp_size"] for p in other] == [2 // tp] * tp
    assert all(p["iteration"] == ITERS for p in ref + other)
    if tp == 2:  # the two TP shards are halves, not copies: half the rows of qkv each
        q0, q1 = other[0]["model"]["blocks.0.qkv.inner.weight"], other[1]["model"]["blocks.0.qkv.inner.weight"]
        assert q0.shape == (48, 32) and not torch.equal(q0, q1)
    full_ref, full = _full_model(ref), _full_model(other)
    for n, w in full_ref.items():
        assert full[n].shape == w.shape, n
        # 5 AdamW steps at lr 3e-3 move weights by ~1e-2; fp32 round-off in the grads stays far below
        assert float((full[n] - w).abs().max()) <= 2e-5, f"{name}: final {n} differs from TP=1 DP=1"


@pytest.fixture(scope="module")
def samples(runs, tmp_path_factory):
    _checked(runs["tp2"], "TP=2 training")
    d = tmp_path_factory.mktemp("samples")
    args = ["--load", runs["tp2"]["save"], "--num-samples", "10", "--steps", "4", "--guidance", "1.5", "--seed", "3"]
    r1 = python(SAMPLE, args + ["--out", d / "tp1"])
    r2 = torchrun(2, SAMPLE, args + ["--out", d / "tp2", "--tensor-model-parallel-size", "2"])
    return r1, r2, d


def test_sample_tp2_checkpoint_at_tp1_matches_tp2(samples):
    r1, r2, d = samples
    r1.check("sample.py at TP=1 from a TP=2 checkpoint")
    r2.check("sample.py at TP=2 from a TP=2 checkpoint")
    a, b = np.load(d / "tp1" / "samples.npz"), np.load(d / "tp2" / "samples.npz")
    assert a["images"].shape == (10, 1, 8, 8) and a["images"].dtype == np.float32
    np.testing.assert_array_equal(a["labels"], np.arange(10) % 10)
    np.testing.assert_array_equal(a["labels"], b["labels"])
    np.testing.assert_allclose(a["images"], b["images"], rtol=0, atol=1e-5)
    # the trained model moved the samples away from its starting noise (a zero-velocity model
    # would return the clamped noise); generate() draws the noise with torch.Generator().manual_seed(seed)
    noise = torch.randn((10, 1, 8, 8), generator=torch.Generator().manual_seed(3)).clamp(-1, 1).numpy()
    assert np.abs(a["images"] - noise).max() > 0.05


@pytest.mark.integration
def test_resume_optimizer_at_other_tp_fails(runs, tmp_path):
    _checked(runs["tp2"], "TP=2 training")
    res = python(PRETRAIN, TRAIN[:2] + ["--train-iters", str(ITERS + 2), "--micro-batch-size", "8",
                                       "--global-batch-size", "16", "--load", runs["tp2"]["save"]])
    assert res.returncode != 0, f"resuming a TP=2 optimizer at TP=1 should fail\n{res.tail()}"
    err = res.stderr
    assert "--tensor-model-parallel-size 2" in err and "uses 1" in err and "--no-load-optim" in err, res.tail()
