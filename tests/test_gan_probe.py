"""benchmarks/gan_probe.py: its core on synthetic token grids, and one end-to-end run on a tiny saved DMD2 run.

The property the probe measures, on grids [N, 128, 4, 4] (the digits critic's) of N(0, 1) whose channel 0 carries
a checkerboard of +-m (reals) or of -+m (fakes, the same pattern's sign flipped): both have the same token mean (a
checkerboard sums to 0 over the grid), so the old head (token mean -> MLP) sees one distribution and must stay at
chance (held-out balanced accuracy < 0.6), while the conv head sees the spatial pattern and must separate them
(> 0.9). On two samples of one distribution both heads stay at chance. (Not 16 or 32 channels: the conv head's
GroupNorm after its 1 x 1 stage then holds one channel per group, normalises it to 0, and the logit is a constant;
64 channels keep two per group.) The metrics themselves are checked on heads of known logits (exact).
End to end: `main` on a 2-cycle debug DMD2 run with --dmd2-gan (the critic saved as a GANCritic: the probe takes its
trunk), a few rows and steps: the result's shape and that every number is finite.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from benchmarks.gan_probe import CHANCE_LOSS, NO_GAN_RANGE, Feats, evaluate, gan_grid, main, train_head
from dmd2_mega import flow
from dmd2_mega.methods.dmd2.gan_heads import build_head

C, GRID = 128, (4, 4)


def clouds(n: int, m: float, seed: int, flip: bool) -> torch.Tensor:
    """[n, C, 4, 4] N(0, 1) with channel 0 + m x checkerboard (its sign flipped when `flip`)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, *GRID, generator=g)
    checker = (torch.arange(GRID[0])[:, None] + torch.arange(GRID[1])[None, :]) % 2 * 2.0 - 1.0
    x[:, 0] += (-m if flip else m) * checker
    return x


def trained(kind: str, real: torch.Tensor, fake: torch.Tensor) -> torch.nn.Module:
    head = build_head(kind, C, GRID, seed=3)
    train_head(head, real, fake, steps=300, batch=64, lr=1e-3, weight_decay=0.01 if kind == "conv" else 0.0,
               clip=10.0, seed=4)
    return head


def test_conv_head_sees_the_pattern_the_mlp_head_cannot():
    real, fake = clouds(512, 1.0, 0, False), clouds(512, 1.0, 1, True)
    held_real, held_fake = clouds(400, 1.0, 2, False), clouds(400, 1.0, 3, True)
    assert torch.allclose(real.flatten(2).mean(2)[:, 0].mean(), fake.flatten(2).mean(2)[:, 0].mean(), atol=0.05)
    conv = evaluate(trained("conv", real, fake), held_real, held_fake)
    mlp = evaluate(trained("mlp", real, fake), held_real, held_fake)
    assert conv["acc"] > 0.9 and conv["loss"] < 0.5, conv
    assert mlp["acc"] < 0.6 and mlp["loss"] > 1.3, mlp


@pytest.mark.parametrize("kind", ["conv", "mlp"])
def test_one_distribution_stays_at_chance(kind):
    real, fake = clouds(512, 1.0, 0, False), clouds(512, 1.0, 1, False)
    held = evaluate(trained(kind, real, fake), clouds(400, 1.0, 2, False), clouds(400, 1.0, 3, False))
    assert 0.4 < held["acc"] < 0.6 and held["loss"] > 1.3, held


class Fixed(torch.nn.Module):
    """A head whose logit is the grid's [0, 0, 0] entry."""

    def forward(self, grid):
        return grid[:, 0, 0, 0].float()


def test_metrics_of_known_logits():
    """Exact: logits 0 everywhere give 2 ln 2 and balanced accuracy 0.5 (every real wrong, every fake right); logits
    +-20 on the right sides give accuracy 1 and L_D 2 softplus(-20); 3 reals right of 4 and 1 fake of 2 give
    (3/4 + 1/2) / 2, whatever the counts."""
    zeros = evaluate(Fixed(), torch.zeros(3, 1, 1, 1), torch.zeros(5, 1, 1, 1))
    assert zeros == {"loss": pytest.approx(CHANCE_LOSS), "acc": 0.5, "acc_real": 0.0, "acc_fake": 1.0}
    right = evaluate(Fixed(), torch.full((4, 1, 1, 1), 20.0), torch.full((2, 1, 1, 1), -20.0))
    assert right["acc"] == 1.0 and right["loss"] == pytest.approx(2 * math.log1p(math.exp(-20)))
    mixed = evaluate(Fixed(), torch.tensor([1.0, 2.0, 3.0, -1.0]).view(4, 1, 1, 1),
                     torch.tensor([-1.0, 1.0]).view(2, 1, 1, 1))
    assert mixed["acc"] == pytest.approx((0.75 + 0.5) / 2)
    assert math.isnan(evaluate(Fixed(), torch.zeros(0, 1, 1, 1), torch.zeros(2, 1, 1, 1))["acc"])


def test_train_head_same_seed_same_head():
    """Bit-exact: the same grids, seed and budget train the same head (the probe's heads see the same batches)."""
    real, fake = clouds(64, 1.0, 0, False), clouds(64, 1.0, 1, True)
    heads = [build_head("conv", C, GRID, seed=3) for _ in range(2)]
    losses = [train_head(h, real, fake, steps=5, batch=8, lr=1e-3, seed=4) for h in heads]
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(heads[0].parameters(), heads[1].parameters()))


def test_feats_halves_and_rows():
    grid = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3, 1, 1)
    f = Feats(grid, torch.tensor([[0.1, 0.2]] * 5))
    assert f.half(0).grid.shape[0] == 2 and f.half(1).grid.shape[0] == 3
    assert torch.equal(f.rows(), grid.flatten(0, 1))
    assert torch.equal(f.rows(f.sigma < 0.15), grid[:, 0])


def test_gan_grid_reads_the_runs_range_as_the_trainer_does():
    """The probe's noise grid from a run's saved args: --sigma-range over everything, else the run's
    --dmd2-gan-sigma-range, else its score range (config.DistillConfig.gan_sigma_range), without --dmd2-gan the
    probe's own range; the points are the run's shifted critic grid's in that range."""
    args = {"gan": {"enabled": True, "sigma_range": [0.05, 0.3]}, "dmd2": {"critic_grid_size": 100},
            "train": {"timestep_shift": 3.0}}
    no_range = {**args, "gan": {"enabled": True}, "dmd2": {"critic_grid_size": 100, "score_sigma_range": [0.1, 0.5]}}
    cases = [(args, None, (0.05, 0.3)), (args, (0.2, 0.4), (0.2, 0.4)), (no_range, None, (0.1, 0.5)),
             ({"gan": {"enabled": False}}, None, NO_GAN_RANGE)]
    for saved, override, want in cases:
        choices, rng, _ = gan_grid(saved, override)
        dmd2, train = saved.get("dmd2", {}), saved.get("train", {})
        size, shift = dmd2.get("critic_grid_size", 1000), train.get("timestep_shift", 1.0)
        sigmas, in_range = flow.critic_grid(size, shift, want)
        assert tuple(rng) == tuple(want) and torch.equal(choices, sigmas[in_range]) and choices.numel() > 0


@pytest.fixture(scope="module")
def tiny_run(debug_teacher, tmp_path_factory):
    """A 2-cycle debug DMD2 run with --dmd2-gan, trained in this process (launch/pretrain_dmd2.main)."""
    from launch import pretrain_dmd2
    save = str(tmp_path_factory.mktemp("gan_probe") / "student")
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        assert pretrain_dmd2.main(["--model-size", "debug", "--teacher-load", debug_teacher, "--micro-batch-size", "4",
                                   "--global-batch-size", "4", "--dmd2-critic-steps-per-rollout", "1", "--lr", "1e-3",
                                   "--train-iters", "2", "--log-interval", "1", "--seed", "3", "--dmd2-gan",
                                   "--dmd2-gan-sigma-range", "0.05", "0.3", "--save", save]) == 0
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return save


def test_main_on_a_tiny_run(tiny_run, tmp_path):
    out = tmp_path / "probe.json"
    res = main(["--run", tiny_run, "--train-rows", "12", "--held-rows", "6", "--draws", "2", "--steps", "3",
                "--batch", "4", "--lrs", "1e-3", "--json", str(out)])
    h = res["header"]
    assert (h["layer"], h["sigma_range"], h["train_rows"], h["held_rows"]) == (0, [0.05, 0.3], 12, 6)
    assert [(r["pair"], r["head"]) for r in res["rows"]] == [
        ("real vs student", "conv"), ("real vs student", "mlp"), ("real vs real", "conv"), ("real vs real", "mlp")]
    for r in res["rows"]:
        assert all(math.isfinite(r[k]) for k in ("held_loss", "held_acc", "train_loss")), r
        assert r["steps"] == 3 and r["params"] > 0
    assert out.is_file() and "| real vs real | mlp | 0.001 |" in res["table"]
