"""Streaming generation with a causal student (issue 29 item 5): `sampling.stream_student` / `FamilyModel.stream`
and `launch/sample.py --stream`.

  a. The streamed clip's first chunk equals the non-streamed few-step sample of the same noise (the first chunk
     sees only itself either way); the later chunks differ (they see the clean cache, not noisy neighbours).
     A cache re-run above level 0 takes one more noise draw and changes only the later chunks.
  b. sample.py --stream on a causal checkpoint (launch/pretrain_flow.py --causal, a few iterations) writes
     2T frames past the training length T, prints the time to the first chunk and the chunks per second, and
     writes each chunk's frames as it comes and timing.json (the first chunk's wait, the total); a bidirectional
     checkpoint with --stream, or --num-frames 0, is a one-line error; a bidirectional checkpoint samples
     --num-frames F in one pass.
"""
import glob
import json
import os

import numpy as np
import pytest
import torch

from dmd2_mega.models import BuildOptions, DataShape
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan.family import WanFamily
from dmd2_mega.sampling import Sampler, stream_student
from tests.test_causal_wan import SPEC, causal, inputs
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
SIGMAS = torch.tensor([1.0, 0.6, 0.3])


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def test_first_chunk_equals_the_non_streamed_sample(world):
    layout = CausalLayout(2)
    m = causal(6, layout)
    _, _, cond = inputs(6, 3)
    noise = torch.randn(len(SIGMAS), 2, 4, 6, 4, 6, generator=torch.Generator().manual_seed(5))
    parallel = Sampler(SIGMAS, 3, 1.0, 1.0)(m, noise, cond)
    streamed = Sampler(SIGMAS, 3, 1.0, 1.0, stream=True)(m, noise, cond)
    assert streamed.shape == parallel.shape == (2, 4, 6, 4, 6)
    assert torch.allclose(streamed[:, :, :2], parallel[:, :, :2], rtol=0, atol=1e-6)
    assert not torch.allclose(streamed[:, :, 2:], parallel[:, :, 2:], atol=1e-3)


def test_the_cache_re_run_above_zero_takes_a_draw_and_moves_only_later_chunks(world):
    m = causal(4, CausalLayout(2))
    _, _, cond = inputs(4, 2)
    assert Sampler(SIGMAS, 3, 1.0, 1.0, stream=True, context_noise=0.2).draws == 4
    assert Sampler(SIGMAS, 3, 1.0, 1.0, stream=True).draws == 3 == Sampler(SIGMAS, 3, 1.0, 1.0).draws
    noise = torch.randn(4, 2, 4, 4, 4, 6, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        clean = torch.cat(list(stream_student(m, noise[:3], cond, SIGMAS)), 2)
        noisy = torch.cat(list(stream_student(m, noise, cond, SIGMAS, context_noise=0.2)), 2)
    assert torch.equal(clean[:, :, :2], noisy[:, :, :2])
    assert not torch.allclose(clean[:, :, 2:], noisy[:, :, 2:], atol=1e-4)


def test_a_bidirectional_model_refuses_to_stream(world):
    from dmd2_mega.errors import ConfigError
    bi = WanFamily().build(SPEC, DataShape(4, (4, 4, 6), cond_shape=(3, 16)))
    with pytest.raises(ConfigError, match="not a causal model"):
        next(stream_student(bi, torch.zeros(3, 1, 4, 4, 4, 6), torch.zeros(1, 3, 16), SIGMAS))
    assert WanFamily().build(SPEC, DataShape(4, (4, 4, 6), cond_shape=(3, 16)),
                             options=BuildOptions(causal=CausalLayout(2))).causal_layout == CausalLayout(2)


# ---- b. launch/sample.py --stream ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(causal, bidirectional) wan-digits checkpoints on moving digits (T = 4 frames), two iterations each."""
    from launch import pretrain_flow
    d = tmp_path_factory.mktemp("stream")
    out = []
    for name, more in (("causal", ["--causal", "--causal-chunk-frames", "2"]), ("bidirectional", [])):
        save = str(d / name)
        with world_of_one():
            rc = pretrain_flow.main(["--model-size", "wan-digits", "--data", "moving-digits", "--micro-batch-size",
                                     "4", "--global-batch-size", "4", "--train-iters", "2", "--save", save, *more])
        assert rc == 0
        out.append(save)
    return out


@pytest.mark.integration
def test_sample_stream_runs_past_the_training_length(checkpoints, tmp_path, capsys):
    from launch import sample
    causal_ckpt, _ = checkpoints
    args = ["--load", causal_ckpt, "--num-samples", "3", "--steps", "2", "--seed", "4"]
    with world_of_one():
        assert sample.main([*args, "--stream", "--num-frames", "8", "--out", str(tmp_path / "long"),
                            "--num-media", "2"]) == 0
    out = capsys.readouterr().out
    assert "> streamed 4 chunks (8 latent frames" in out and "first chunk after" in out and "chunks/s" in out, out
    with np.load(tmp_path / "long" / "samples.npz") as npz:
        assert npz["images"].shape == (3, 1, 8, 16, 16)
    frames = sorted(glob.glob(str(tmp_path / "long" / "stream" / "001" / "frame_*.png")))
    assert [os.path.basename(f) for f in frames] == [f"frame_{t:05d}.png" for t in range(8)]
    timing = json.loads((tmp_path / "long" / "timing.json").read_text())  # the first chunk, not the first clip
    assert timing["stream"] is True and timing["num_samples"] == 3
    assert 0 < timing["first_output_s"] < timing["total_s"]


@pytest.mark.integration
def test_stream_flags_refuse_what_cannot_stream(checkpoints, tmp_path, capsys):
    from launch import sample
    causal_ckpt, bidirectional = checkpoints
    with world_of_one():
        assert sample.main(["--load", bidirectional, "--stream", "--out", str(tmp_path / "a")]) == 1
    assert "--stream needs a causal checkpoint" in capsys.readouterr().err
    assert sample.main(["--load", causal_ckpt, "--num-frames", "0", "--out", str(tmp_path / "b")]) == 1
    assert "--num-frames 0: must be >= 1" in capsys.readouterr().err


@pytest.mark.integration
def test_a_bidirectional_model_samples_other_lengths_in_one_pass(checkpoints, tmp_path):
    """--num-frames without --stream: all F frames denoised at once (a bidirectional model past its training
    length, the quickstart's 2T row); timing.json's first output is then the first batch of whole clips."""
    from launch import sample
    _, bidirectional = checkpoints
    with world_of_one():
        assert sample.main(["--load", bidirectional, "--num-samples", "3", "--steps", "2", "--num-frames", "8",
                            "--batch-size", "2", "--num-media", "0", "--out", str(tmp_path / "long")]) == 0
    with np.load(tmp_path / "long" / "samples.npz") as npz:
        assert npz["images"].shape == (3, 1, 8, 16, 16) and np.isfinite(npz["images"]).all()
    timing = json.loads((tmp_path / "long" / "timing.json").read_text())
    assert timing["stream"] is False and timing["batch_size"] == 2
    assert 0 < timing["first_output_s"] < timing["total_s"]  # two batches: the first comes before the end
