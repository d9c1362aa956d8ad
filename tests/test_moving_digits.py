"""`--data moving-digits` and its metric.

  a. The dataset: deterministic; shapes, splits (held-out clips from held-out digit images only), one clip
     per (image, direction); every frame equals a slice-assignment reference (the digit pasted at its corner);
     the paths are the centred ones written out by hand; conditions are the prompt embeddings,
     the negative is the empty prompt, and cond -> (digit, direction) is exact (other embeddings are refused).
  b. The metric separates real held-out clips (high digit / direction accuracy, consistency, warp error 0)
     from a frozen first frame (no motion), clips played backwards (wrong direction) and flickering clips
     (a different digit image each frame); the centroid velocity of a real clip is exactly its motion.
  c. report_video: table rows and a GIF grid whose frame t is the reference layout of frame t.
  d. Smoke: launch/pretrain_flow.py --model-size wan-digits --data moving-digits, 2 iterations in-process with
     the periodic eval, and launch/sample.py on it (balanced conditions, digits / directions in samples.npz).
"""
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from dmd2_mega.data import build_dataset
from dmd2_mega.data.digits import _load, split_indices
from dmd2_mega.data.moving_digits import (FRAMES, GLYPH, HEIGHT, STEPS, VOCAB, WIDTH, MovingDigitsDataset,
                                          decode_conditions, empty_prompt, prompt_embedding, prompt_tokens)
from dmd2_mega.errors import DataError, EvalInputError
from dmd2_mega.eval.classifier import CACHE_ENV
from dmd2_mega.eval.frame_classifier import CACHE_NAME
from dmd2_mega.eval.moving_digits import centroid_tracks, evaluate_moving_digits, fit_velocity, warp_error
from dmd2_mega.eval import report_video
from dmd2_mega.sampling import eval_conditions
from tests.utils import world_of_one

N_EVAL = 400  # held-out clips per metric case (100 per direction)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache dir via $DMD2_MEGA_CACHE: the first evaluate call trains the frame classifier into it."""
    d = tmp_path_factory.mktemp("moving_digits_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(d))
        yield d


@pytest.fixture(scope="module")
def train():
    return build_dataset("moving-digits", "train")


@pytest.fixture(scope="module")
def held():
    return build_dataset("moving-digits", "heldout")


# ---------------------------------------------------------------- a. the dataset
def test_shapes_splits_and_determinism(train, held):
    assert isinstance(train, MovingDigitsDataset) and train.num_classes is None
    assert train.cond_shape == (4, 16) and train.spatial == (FRAMES, HEIGHT, WIDTH) and train.channels == 1
    train_ids, held_ids = split_indices()
    assert train.x.shape == (4 * len(train_ids), 1, FRAMES, HEIGHT, WIDTH) == (5752, 1, 4, 16, 16)
    assert held.x.shape == (4 * len(held_ids), 1, 4, 16, 16) and held.cond.shape == (1436, 4, 16)
    assert set(train.image_index.tolist()) == set(train_ids.tolist())
    assert set(held.image_index.tolist()) == set(held_ids.tolist())
    # one clip per (image, direction)
    pairs = held.image_index * 4 + held.direction
    assert len(torch.unique(pairs)) == len(held)
    again = MovingDigitsDataset("heldout")
    assert torch.equal(again.x, held.x) and torch.equal(again.cond, held.cond)
    assert torch.equal(again.corners, held.corners)
    with pytest.raises(DataError, match="split must be 'train' or 'heldout'"):
        MovingDigitsDataset("test")


def test_frames_match_pasted_digit_reference(held):
    images, labels = _load()
    g = torch.Generator().manual_seed(0)
    for n in torch.randint(len(held), (24,), generator=g).tolist():
        glyph = images[int(held.image_index[n])] / 8.0 - 1.0
        assert held.digit[n] == labels[int(held.image_index[n])]
        for t in range(FRAMES):
            r, c = held.corners[n, t].tolist()
            ref = -np.ones((HEIGHT, WIDTH), np.float32)
            ref[r:r + GLYPH, c:c + GLYPH] = glyph
            np.testing.assert_array_equal(held.x[n, 0, t].numpy(), ref)


# The centred paths written out by hand: (direction, speed) -> the corner (row, col) of frames 0..3.
PATHS = {(0, 1): [(4, 2), (4, 3), (4, 4), (4, 5)], (0, 2): [(4, 1), (4, 3), (4, 5), (4, 7)],
         (1, 1): [(4, 5), (4, 4), (4, 3), (4, 2)], (1, 2): [(4, 7), (4, 5), (4, 3), (4, 1)],
         (2, 1): [(2, 4), (3, 4), (4, 4), (5, 4)], (2, 2): [(1, 4), (3, 4), (5, 4), (7, 4)],
         (3, 1): [(5, 4), (4, 4), (3, 4), (2, 4)], (3, 2): [(7, 4), (5, 4), (3, 4), (1, 4)]}


def test_trajectories(train, held):
    for ds in (train, held):
        expect = torch.tensor([PATHS[k] for k in zip(ds.direction.tolist(), ds.speed.tolist())])
        assert torch.equal(ds.corners, expect)
        assert set(ds.speed.tolist()) == {1, 2} and 0.4 < ds.speed.eq(2).double().mean() < 0.6
        assert torch.bincount(ds.direction).tolist() == [len(ds) // 4] * 4


def test_conditions_and_exact_lookup(train, held):
    d, r = decode_conditions(train.cond)
    assert torch.equal(d, train.digit) and torch.equal(r, train.direction)
    assert torch.equal(prompt_tokens(torch.tensor([3]), torch.tensor([2]))[0],
                       torch.tensor([VOCAB.index(w) for w in ("digit", "3", "moves", "down")]))
    table = prompt_embedding(torch.arange(40) % 10, torch.arange(40) // 10)
    assert len(torch.unique(table.flatten(1), dim=0)) == 40
    assert torch.equal(held.negative, empty_prompt()) and held.negative.abs().sum() > 0
    assert torch.equal(held.null_cond(3), empty_prompt().expand(3, 4, 16))
    with pytest.raises(DataError, match="no prompt"):
        decode_conditions(held.negative[None])
    with pytest.raises(DataError, match="row 1 is no prompt"):
        decode_conditions(torch.stack([held.cond[0], held.cond[1] + 1e-2]))
    with pytest.raises(DataError, match=r"embeddings \[N, 4, 16\]"):
        decode_conditions(held.cond[:, :3])
    with pytest.raises(DataError, match="direction must lie in"):
        prompt_embedding(torch.tensor([1]), torch.tensor([4]))
    # eval_conditions: every (digit, direction) pair twice in 80 samples
    d, r = decode_conditions(eval_conditions(held, 80))
    assert torch.equal(torch.bincount(d * 4 + r, minlength=40), torch.full((40,), 2))


# ---------------------------------------------------------------- b. the metric
def _subset(held):
    """N_EVAL held-out clips, 100 per direction."""
    idx = torch.cat([torch.nonzero(held.direction == k)[:N_EVAL // 4, 0] for k in range(4)])
    return held.x[idx], held.digit[idx], held.direction[idx], held.speed[idx]


def test_velocity_is_exact_motion_and_warp_zero(held):
    x, _, direction, speed = _subset(held)
    v = fit_velocity(centroid_tracks(x))
    torch.testing.assert_close(v, (STEPS[direction] * speed[:, None]).double(), atol=1e-9, rtol=0)
    assert warp_error(x).abs().max() == 0
    # 3 px / frame (wrapping round) is outside the +-2 px shift window: no shift explains the change
    fast = torch.stack([torch.roll(x[:, 0, 0], 3 * t, dims=-1) for t in range(FRAMES)], 1)[:, None]
    assert warp_error(fast).min() > 0


def test_real_heldout_clips_score_well(cache, held):
    x, digit, direction, _ = _subset(held)
    r = evaluate_moving_digits(x, digit, direction)
    assert (cache / CACHE_NAME).is_file()
    assert r["classifier_heldout_accuracy"] > 0.95 and r["digit_accuracy"] > 0.95
    assert r["direction_accuracy"] == 1.0 and r["warp_error"] == 0.0 and r["consistency"] > 0.95
    assert 1.0 < r["mean_speed"] < 2.0 and r["fd_ratio"] < 2.5 and r["num_samples"] == N_EVAL


def test_frozen_first_frame_has_no_motion(cache, held):
    x, digit, direction, _ = _subset(held)
    r = evaluate_moving_digits(x[:, :, :1].expand_as(x), digit, direction)
    assert r["mean_speed"] == 0.0 and r["direction_accuracy"] == 0.0
    assert r["digit_accuracy"] > 0.9  # the frames themselves are real digits


def test_reversed_clips_move_the_wrong_way(cache, held):
    x, digit, direction, _ = _subset(held)
    r = evaluate_moving_digits(x.flip(2), digit, direction)
    assert r["direction_accuracy"] == 0.0 and r["mean_speed"] > 1.0 and r["digit_accuracy"] > 0.9


def test_flickering_clips_are_inconsistent(cache, held):
    """Frame t of clip n from another random held-out clip: real frames, but the digit changes between frames."""
    x, digit, direction, _ = _subset(held)
    g = torch.Generator().manual_seed(1)
    other = torch.randint(len(held), (N_EVAL, FRAMES), generator=g)
    flicker = held.x[other, 0, torch.arange(FRAMES)][:, None]
    r = evaluate_moving_digits(flicker, digit, direction)
    assert r["consistency"] < 0.3 and r["warp_error"] > 0.1 and r["digit_accuracy"] < 0.3


def test_input_errors(cache, held):
    x, digit, direction, _ = _subset(held)
    with pytest.raises(EvalInputError, match=r"clips must have shape \[N, 1, 4, 16, 16\]"):
        evaluate_moving_digits(x[:, :, :3], digit, direction)
    with pytest.raises(EvalInputError, match=r"must lie in \[-1, 1\]"):
        evaluate_moving_digits((x + 1) * 127.5, digit, direction)
    with pytest.raises(EvalInputError, match=r"directions must lie in \[0, 4\)"):
        evaluate_moving_digits(x, digit, direction + 1)
    with pytest.raises(EvalInputError, match=r"digits must have shape \[N\]"):
        evaluate_moving_digits(x, digit[:-1], direction)


# ---------------------------------------------------------------- c. report_video
def test_report_table_and_gif(cache, held, tmp_path, capsys):
    x, digit, direction, _ = _subset(held)
    for name, clips in (("real", x), ("backwards", x.flip(2))):
        np.savez(tmp_path / f"{name}.npz", images=clips.numpy(), digits=digit.numpy(), directions=direction.numpy())
    gif, js = tmp_path / "grid.gif", tmp_path / "m.json"
    assert report_video.main([f"real={tmp_path / 'real.npz'}", f"backwards={tmp_path / 'backwards.npz'}",
                              "--gif", str(gif), "--json", str(js)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| real") or
            line.startswith("| backwards")]
    assert "| 100.0% |" in rows[0] and "| 0.0% |" in rows[1]
    assert json.loads(js.read_text())["backwards"]["direction_accuracy"] == 0.0
    frames = [np.array(f.convert("L")) for f in ImageSequence.Iterator(Image.open(gif))]
    assert len(frames) == FRAMES and frames[0].shape == (2 * HEIGHT * 4, 10 * WIDTH * 4)
    j = 7  # column j: the first clip of digit j moving in direction j mod 4
    n = int(torch.nonzero((digit == j) & (direction == j % 4))[0, 0])
    def cell(frame):  # a frame in [-1, 1] as the GIF shows it: uint8, upscaled 4x
        return np.round((frame.numpy() + 1) * 127.5).astype(np.uint8).repeat(4, 0).repeat(4, 1)

    for t in range(FRAMES):
        np.testing.assert_array_equal(frames[t][:64, j * 64:(j + 1) * 64], cell(x[n, 0, t]))
        np.testing.assert_array_equal(frames[t][64:, j * 64:(j + 1) * 64], cell(x[n, 0, FRAMES - 1 - t]))
    np.savez(tmp_path / "bad.npz", images=x.numpy())
    assert report_video.main([f"bad={tmp_path / 'bad.npz'}"]) == 2
    assert "missing key(s) ['digits', 'directions']" in capsys.readouterr().err


# ---------------------------------------------------------------- d. smoke: train + sample in-process
@pytest.mark.integration
def test_pretrain_flow_and_sample_smoke(cache, tmp_path, capsys):
    from launch import pretrain_flow, sample
    save = str(tmp_path / "teacher")
    with world_of_one():
        rc = pretrain_flow.main(["--model-size", "wan-digits", "--data", "moving-digits", "--micro-batch-size", "8",
                                 "--global-batch-size", "8", "--train-iters", "2", "--log-interval", "1",
                                 "--save", save, "--eval-interval", "2", "--eval-num-samples", "8",
                                 "--eval-steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "> eval at iteration 2:" in out, out[-2000:]
    assert "direction_accuracy=" in out and "warp_error=" in out, out[-2000:]
    with world_of_one():
        rc = sample.main(["--load", save, "--num-samples", "8", "--steps", "2", "--out", str(tmp_path / "s")])
    assert rc == 0
    with np.load(tmp_path / "s" / "samples.npz") as npz:
        assert npz["images"].shape == (8, 1, FRAMES, HEIGHT, WIDTH)
        assert npz["digits"].tolist() == list(range(8)) and npz["directions"].tolist() == [0] * 8
