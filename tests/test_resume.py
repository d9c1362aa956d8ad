"""Checkpoint / resume of launch/pretrain_flow.py (world of one, debug model, global batch 16 =
2 micro-batches of 8, cosine LR over --lr-decay-iters 6 so the schedule does not depend on
--train-iters).

  straight:  6 iterations, saving at 3 and 6
  split:     3 iterations (--train-iters 3, save), then --load the same dir, --train-iters 6
The noise of micro-batch j at iteration t comes from a generator keyed by (seed, t, j), the sampler
position and the AdamW moments and step counts are restored, so the split run must reproduce the
straight run's per-iteration loss and grad norm exactly (fp32, same kernels) and end with the same
weights and optimizer state. The checkpoint file must hold iteration, optimizer step counts and the
sampler's consumed_samples; no *.tmp file or directory may remain after a save.
"""
import os
import shutil

import pytest
import torch

from dmd2_mega.train.checkpoint import iter_dir, rank_file
from dmd2_mega.train.curves import CURVES_FILE
from dmd2_mega.train.curves_plot import CURVES_PNG
from tests.utils import PRETRAIN, assert_traces_close, find_tmp, python, read_trace, run_parallel

pytestmark = pytest.mark.timeout(240)
INTEGRATION_FIXTURES = ("runs",)  # fixtures that launch processes: their tests are marked integration

COMMON = ["--model-size", "debug", "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3",
          "--lr-warmup-iters", "1", "--lr-decay-iters", "6", "--log-interval", "2", "--seed", "11"]


def ckpt(root: str, it: int) -> dict:
    return torch.load(rank_file(iter_dir(root, it), 0), map_location="cpu", weights_only=False)


def adam_state(optimizer_state: dict) -> dict:
    """The torch AdamW state {param index: {step, exp_avg, exp_avg_sq}} inside the saved optimizer
    (dmd2_mega.train.optim.Optimizer nests it under 'inner'; a bare torch optimizer has it at the top)."""
    return optimizer_state.get("inner", optimizer_state)["state"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    straight, split = str(d / "straight"), str(d / "split")
    first = run_parallel({
        "6 straight iterations": lambda: python(PRETRAIN, COMMON + ["--train-iters", "6", "--save", straight,
                                                                    "--save-interval", "3",
                                                                    "--loss-trace", d / "straight.jsonl"]),
        "first 3 iterations": lambda: python(PRETRAIN, COMMON + ["--train-iters", "3", "--save", split,
                                                                 "--loss-trace", d / "split_a.jsonl"])})
    for what, res in first.items():
        res.check(what)
    first_ckpt = str(d / "split_at_3")
    shutil.copytree(split, first_ckpt)  # the state the resume starts from, before it is overwritten
    res = python(PRETRAIN, COMMON + ["--train-iters", "6", "--save", split, "--load", split,
                                     "--loss-trace", d / "split_b.jsonl"]).check("resume for 3 more")
    return {"straight": straight, "split": split, "split_at_3": first_ckpt, "resume_log": res.stdout,
            "trace_straight": read_trace(d / "straight.jsonl"),
            "trace_split": read_trace(d / "split_a.jsonl") + read_trace(d / "split_b.jsonl")}


def test_resume_reproduces_loss_trace(runs):
    assert "resumed from" in runs["resume_log"] and "at iteration 3" in runs["resume_log"], runs["resume_log"]
    a, b = runs["trace_split"], runs["trace_straight"]
    assert [r["iteration"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert_traces_close(a, b, 0.0, "3 + resume + 3 vs 6 straight")  # exactly: same kernels, restored state
    assert len({r["loss"] for r in b}) == 6, "losses should differ between iterations"


def test_resume_reproduces_final_weights_and_optimizer(runs):
    a, b = ckpt(runs["split"], 6), ckpt(runs["straight"], 6)
    assert a["iteration"] == b["iteration"] == 6
    for n, w in b["model"].items():
        if w is None:
            continue
        assert torch.equal(a["model"][n], w), f"final weight {n} differs after resume"
    sa, sb = adam_state(a["optimizer"]), adam_state(b["optimizer"])
    assert sa.keys() == sb.keys() and len(sb) == sum(w is not None for w in b["model"].values())
    for k in sb:
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][field], sb[k][field]), f"AdamW {field} of param {k} differs after resume"
    assert a["sampler"]["consumed_samples"] == b["sampler"]["consumed_samples"] == 6 * 16


def test_checkpoint_contents(runs):
    for root in (runs["split_at_3"], runs["straight"]):
        p = ckpt(root, 3)
        assert p["iteration"] == 3
        assert p["sampler"]["consumed_samples"] == 3 * 16
        steps = {float(s["step"]) for s in adam_state(p["optimizer"]).values()}
        assert steps == {3.0}, f"AdamW step counts in {root}: {steps}"
        assert p["tp_size"] == 1 and p["args"]["train"]["global_batch_size"] == 16
        assert {"model", "optimizer", "scheduler", "rng", "partition_dims"} <= p.keys()
    assert open(os.path.join(runs["straight"], "latest_checkpointed_iteration.txt")).read().strip() == "6"
    # the lock (run_lock.py) and the run's training curves (train/curves.py, curves_plot.py) beside the checkpoints
    assert sorted(os.listdir(runs["straight"])) == [".dmd2_mega.lock", CURVES_FILE, CURVES_PNG, "iter_0000003",
                                                    "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_no_tmp_left_after_save(runs):
    for root in (runs["straight"], runs["split"], runs["split_at_3"]):
        assert not find_tmp(root), find_tmp(root)
        assert not [n for n in os.listdir(root) if n.startswith(".write_probe")], os.listdir(root)
