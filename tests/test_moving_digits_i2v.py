"""`--data moving-digits-i2v[:T]` (image-to-video moving digits), `--model-size wan-digits-i2v` and the first-frame
metric.

  a. The dataset: the clips of moving-digits bit for bit; cond = the prompt embedding (text part [4, 16], bit for bit
     moving-digits' cond) then the image part [1, T, 16, 16] = the clip's first frame and zero frames; cond_parts,
     the negative (the empty prompt, text only) and its shape; the named size reads the concat form.
  b. Text-only decoding stays exact on the flat conditions (the text part only); samples.npz's arrays
     (`condition_labels`) carry the given first frames; the eval conditions pair every (digit, direction) prompt with
     the first frame of a held-out clip of that pair, whatever the split.
  c. The first-frame error: a clip starting with the given frame scores 0 (and its digit matches), a frame moved by
     +-0.25 on every pixel scores 0.25 (exact: the pixels are multiples of 1/8).
  d. End to end in process: pretrain_flow (2 steps) on wan-digits-i2v, DMD2 (2 cycles) from it, launch/sample.py on
     both (the teacher with CFG) writes the given first frames, report_video shows the first-frame columns.
"""
import numpy as np
import pytest
import torch

from dmd2_mega.data import build_dataset
from dmd2_mega.data.moving_digits import (HEIGHT, WIDTH, decode_conditions, empty_prompt, frames_of_spec, parse_spec,
                                          prompt_embedding)
from dmd2_mega.data.moving_digits_i2v import MovingDigitsI2VDataset, given_first_frames
from dmd2_mega.errors import DataError
from dmd2_mega.eval import report_video
from dmd2_mega.eval.data_metrics import metrics_for_data
from dmd2_mega.eval.moving_digits import evaluate_moving_digits, first_frame_error
from dmd2_mega.models import get_spec
from dmd2_mega.sampling import eval_conditions
from dmd2_mega.train.checkpoint import load_payload
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
TEXT = 4 * 16


@pytest.fixture(scope="module")
def held():
    return build_dataset("moving-digits-i2v", "heldout")


@pytest.fixture(scope="module")
def plain():
    return build_dataset("moving-digits", "heldout")


# ---------------------------------------------------------------- a. the dataset and the named size
@pytest.mark.parametrize("frames", [4, 7])
def test_condition_is_the_prompt_then_the_first_frame_and_zero_frames(plain, frames):
    ds = build_dataset(f"moving-digits-i2v:{frames}", "heldout") if frames != 4 else build_dataset("moving-digits-i2v",
                                                                                                  "heldout")
    ref = plain if frames == 4 else build_dataset(f"moving-digits:{frames}", "heldout")
    assert isinstance(ds, MovingDigitsI2VDataset) and ds.frames == frames and len(ds) == len(ref)
    assert ds.source == (f"moving-digits-i2v:{frames}[heldout]" if frames != 4 else "moving-digits-i2v[heldout]")
    assert ds.cond_parts == (("text", (4, 16)), ("image", (1, frames, HEIGHT, WIDTH)))
    assert ds.cond_shape == (TEXT + frames * HEIGHT * WIDTH,) and ds.negative_shape == (4, 16)
    assert torch.equal(ds.negative, empty_prompt()) and "the empty prompt" in ds.null_note
    # bit-exact: the same clips and prompts as --data moving-digits[:T]
    assert torch.equal(ds.x, ref.x) and torch.equal(ds.cond[:, :TEXT], ref.cond.flatten(1))
    image = ds.cond[:, TEXT:].view(len(ds), 1, frames, HEIGHT, WIDTH)
    assert torch.equal(image[:, :, 0], ds.x[:, :, 0]) and not image[:, :, 1:].any()
    x, c = ds.get_batch(torch.tensor([3, 0, 3]))
    assert torch.equal(x, ds.x[[3, 0, 3]]) and torch.equal(c, ds.cond[[3, 0, 3]])
    with pytest.raises(DataError, match="keeps each sample's image"):
        ds.null_cond(2)  # CFG's negative is the model's (negative_for): the empty prompt with each sample's image


def test_named_size_is_wan_digits_in_the_concat_form():
    spec, t2v = get_spec("wan-digits-i2v"), get_spec("wan-digits")
    assert (spec.in_channels, spec.out_channels, spec.mask_channels, spec.image_dim) == (6, 1, 4, None)
    for name in ("num_heads", "head_dim", "num_layers", "ffn_dim", "text_dim", "freq_dim", "patch_size"):
        assert getattr(spec, name) == getattr(t2v, name), name


def test_spec_names():
    assert parse_spec("moving-digits-i2v") == ("moving-digits-i2v", 4) and frames_of_spec("moving-digits-i2v:9") == 9
    assert parse_spec("moving-digits:9") == ("moving-digits", 9) and parse_spec("moving-digits-i2") is None
    for bad in ("moving-digits-i2v:1", "moving-digits-i2v:x"):
        with pytest.raises(DataError, match=rf"^--data {bad}: the frame count T of moving-digits-i2v:T"):
            build_dataset(bad)


# ---------------------------------------------------------------- b. decoding and the eval conditions
def test_text_only_decoding_is_exact(held, plain):
    d, r = decode_conditions(held.cond)
    assert torch.equal(d, held.digit) and torch.equal(r, held.direction)
    d0, r0 = decode_conditions(plain.cond)  # the text-to-video conditions decode as before
    assert torch.equal(d0, d) and torch.equal(r0, r)
    labels = held.condition_labels(held.cond[:5])
    assert sorted(labels) == ["digits", "directions", "first_frames"]
    assert np.array_equal(labels["digits"], held.digit[:5].numpy())
    assert labels["first_frames"].dtype == np.float32 and np.array_equal(labels["first_frames"], held.x[:5, :, 0])
    assert sorted(plain.condition_labels(plain.cond[:5])) == ["digits", "directions"]
    bad = held.cond[:2].clone()
    bad[1, 5] += 1e-2  # a text part that is no prompt
    with pytest.raises(DataError, match="row 1 is no prompt"):
        decode_conditions(bad)
    with pytest.raises(DataError, match=r"embeddings \[N, 4, 16\]"):
        decode_conditions(held.cond[:, :TEXT + 100])  # an image part that is no whole number of frames


def test_eval_conditions_pair_each_prompt_with_a_heldout_first_frame(held):
    n = 120
    cond = eval_conditions(held, n)
    assert cond.shape == (n, TEXT + 4 * HEIGHT * WIDTH)
    d, r = decode_conditions(cond)
    assert torch.equal(torch.bincount(d * 4 + r, minlength=40), torch.full((40,), 3))
    assert torch.equal(cond[:, :TEXT], prompt_embedding(d, r).flatten(1))
    first = given_first_frames(cond)
    assert not cond[:, TEXT + HEIGHT * WIDTH:].any()  # zero frames after the first
    for k in range(n):  # the first frame of a held-out clip of the prompt's (digit, direction)
        same = (held.digit == d[k]) & (held.direction == r[k])
        assert (held.x[same, :, 0] == first[k]).flatten(1).all(1).any(), k
    assert not torch.equal(first[:40], first[40:80])  # each round of the 40 prompts has other glyphs
    assert torch.equal(held.balanced_conditions(30, 50), cond[50:80])
    train = build_dataset("moving-digits-i2v", "train")
    assert torch.equal(eval_conditions(train, n), cond)  # held-out first frames whatever the split


# ---------------------------------------------------------------- c. the first-frame error
def test_first_frame_error_is_zero_for_the_given_frame_and_the_perturbation_otherwise(held):
    idx = torch.arange(0, len(held), 36)[:40]
    x = held.x[idx]
    given = x[:, :, 0].clone()
    assert torch.equal(first_frame_error(x, given), torch.zeros(len(x)))
    moved = torch.where(given < 0, given + 0.25, given - 0.25)  # every pixel moved by 0.25, inside [-1, 1]
    assert torch.equal(first_frame_error(x, moved), torch.full((len(x),), 0.25))
    exact = evaluate_moving_digits(x, held.digit[idx], held.direction[idx], first_frames=given)
    assert exact["first_frame_error"] == 0.0 and exact["first_frame_match"] == 1.0
    off = evaluate_moving_digits(x, held.digit[idx], held.direction[idx], first_frames=moved)
    assert off["first_frame_error"] == 0.25
    assert "first_frame_error" not in evaluate_moving_digits(x, held.digit[idx], held.direction[idx])
    # the trainers' periodic eval decodes the text part of I2V conditions
    assert metrics_for_data("moving-digits-i2v", x, held.cond[idx])["direction_accuracy"] == 1.0


# ---------------------------------------------------------------- d. end to end
@pytest.mark.integration
def test_pretrain_dmd2_and_sample_write_the_first_frame_metric(held, tmp_path, capsys):
    from launch import pretrain_dmd2, pretrain_flow, sample
    data = ["--model-size", "wan-digits-i2v", "--data", "moving-digits-i2v", "--log-interval", "1", "--seed", "3"]
    teacher, student = str(tmp_path / "teacher"), str(tmp_path / "student")
    with world_of_one():
        rc = pretrain_flow.main([*data, "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2",
                                 "--lr", "3e-3", "--save", teacher])
    assert rc == 0, capsys.readouterr().err[-2000:]  # condition dropout keeps each sample's image (negative_for)
    with world_of_one() as ps:
        info = load_payload(teacher, ps)["data_info"]
    assert [[n, list(s)] for n, s in held.cond_parts] == [[n, list(s)] for n, s in info["cond_parts"]]
    with world_of_one():
        assert pretrain_dmd2.main([*data, "--teacher-load", teacher, "--micro-batch-size", "2", "--global-batch-size",
                                   "2", "--dmd2-critic-steps-per-rollout", "2", "--dmd2-denoising-steps", "2",
                                   "--dmd2-teacher-guidance-scale", "2", "--train-iters", "2", "--lr", "1e-3",
                                   "--save", student]) == 0
    rows = []
    for name, load, more in (("teacher", teacher, ["--steps", "2", "--guidance", "2"]), ("student", student, [])):
        out = tmp_path / f"samples_{name}"
        with world_of_one():
            assert sample.main(["--load", load, "--num-samples", "6", "--num-media", "0", "--out", str(out),
                                *more]) == 0
        with np.load(out / "samples.npz") as npz:
            assert npz["images"].shape == (6, 1, 4, HEIGHT, WIDTH) and np.isfinite(npz["images"]).all()
            assert npz["digits"].tolist() == list(range(6)) and npz["directions"].tolist() == [0] * 6
            assert np.array_equal(npz["first_frames"], given_first_frames(held.balanced_conditions(6)).numpy())
        rows.append(f"{name}={out / 'samples.npz'}")
    capsys.readouterr()
    assert report_video.main(rows) == 0
    table = capsys.readouterr().out
    assert "| first-frame error | first-frame digit |" in table and len(table.strip().splitlines()) == 4, table
