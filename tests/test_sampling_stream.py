"""launch/sample.py samples in batches and writes samples.npz as it goes (`sampling.SeededNoise`, `sample_batches`,
`eval.npz_stream.NpzStream`), with the samples `generate` / `generate_student` make from one up-front draw.

  a. `SeededNoise` read in batches equals torch.randn((draws, n, *shape)) from the seeded generator, bit for bit,
     at sizes where torch's 16-value blocks and its redrawn tail fall inside, across and at the end of batches.
  b. `NpzStream`, arrays interleaved row block by row block, reads back as np.savez's; too few rows are refused;
     an aborted stream leaves nothing that writes into the closed file.
  c. `sample_batches` at a batch that holds all n equals generate / generate_student bit for bit (teacher with CFG,
     student on 3 sigmas; a debug DiT with perturbed weights); at batch 3 to float32 rounding.
  d. sample.py: every samples.npz key (images, labels, prompts, digits, directions) at --batch-size 2 equals the one
     at the default batch (class teacher, text teacher with --prompts, moving digits); the peak of the heap held
     (glibc mallinfo2, polled) while sampling 12000 samples is that of 1200 (one O(N) array of images or noise
     would add 3 MB); --data whose condition width is not the model's is one DataError line naming both widths.
"""
import ctypes
import threading
import time

import numpy as np
import pytest
import torch

from dmd2_mega.train.builders import build_model
from dmd2_mega.config import ModelConfig
from dmd2_mega.data.prompts import write_prompts
from dmd2_mega.data.shard_writer import write_shards
from dmd2_mega.eval.npz_stream import NpzStream
from dmd2_mega.sampling import Sampler, SeededNoise, generate, generate_student, sample_batches
from launch import pretrain_flow
from launch import sample as sample_script
from tests.utils import world_of_one

DIGITS_INFO = {"in_channels": 1, "latent_shape": [1, 8, 8], "num_classes": 10, "cond_shape": None, "image_size": 8}


# ---- a. noise ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,shape,draws,batch", [(1, (1,), 1, 1), (7, (1, 3), 2, 2), (33, (5,), 3, 4),
                                                  (3, (1, 8, 8), 4, 1), (5, (4, 3, 4, 6), 2, 3), (40, (3,), 1, 64)])
def test_seeded_noise_is_the_up_front_draw_bit_for_bit(n, shape, draws, batch):
    want = torch.randn((draws, n, *shape), generator=torch.Generator().manual_seed(11))
    noise = SeededNoise(11, n, shape, draws)
    got = torch.cat([noise.take(min(batch, n - lo)) for lo in range(0, n, batch)], dim=1)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="taken"):
        noise.take(1)


# ---- b. the npz writer ------------------------------------------------------------------------------------

def test_npz_stream_reads_back_as_savez(tmp_path):
    g = np.random.default_rng(0)
    arrays = {"images": g.normal(size=(7, 2, 3)).astype(np.float32), "labels": np.arange(7) % 3,
              "prompts": np.array(["a", "bc", "", "def", "a", "bc", ""])}
    with open(tmp_path / "s.npz", "wb") as f:
        stream = NpzStream(f, {k: (v.shape, v.dtype) for k, v in arrays.items()}, str(tmp_path))
        for lo, hi in ((0, 3), (3, 4), (4, 7)):
            for k, v in arrays.items():
                stream.write(k, v[lo:hi])
        stream.close()
    got = np.load(tmp_path / "s.npz")
    assert sorted(got.files) == sorted(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
    with open(tmp_path / "t.npz", "wb") as f:
        stream = NpzStream(f, {"labels": ((3,), np.int64)}, str(tmp_path))
        stream.write("labels", np.arange(2))
        with pytest.raises(ValueError, match="fewer rows"):
            stream.close()
        with pytest.raises(ValueError, match="do not fit"):
            stream.write("labels", np.arange(2))


def test_npz_stream_abort_leaves_nothing_to_finish(tmp_path, monkeypatch):
    """An interrupted write (Ctrl-C in sample.py) aborts: the spools go, and nothing is left that writes into the
    closed file when collected (was `Exception ignored in ZipFile.__del__: seek of closed file`)."""
    import gc
    import sys
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with open(tmp_path / "s.npz", "wb") as f:
        stream = NpzStream(f, {"images": ((4, 2), np.float32), "labels": ((4,), np.int64)}, str(tmp_path))
        stream.write("images", np.zeros((2, 2)))
        stream.write("labels", np.arange(2))
        stream.abort()
    del stream
    gc.collect()
    assert unraisable == [] and sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]


# ---- c. batches against the one-draw samplers -------------------------------------------------------------

def test_sample_batches_are_the_one_draw_samples():
    n, shape = 7, (1, 8, 8)
    cond = torch.arange(n) % 10
    with world_of_one() as ps:
        model = build_model(ModelConfig(size="debug"), DIGITS_INFO, ps)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():  # the output layer starts at zero: make the velocity matter
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        sigmas = torch.tensor([1.0, 0.6, 0.3])
        cases = {"teacher": (Sampler(None, 3, 1.5, 1.0), generate(model, cond, shape=shape, steps=3, guidance=1.5,
                                                                   shift=1.0, seed=4, device=ps.device)),
                 "student": (Sampler(sigmas, 3, 1.0, 1.0), generate_student(model, cond, sigmas, shape=shape, seed=4,
                                                                             device=ps.device))}
        for name, (sampler, want) in cases.items():
            for batch in (n, 64, 3):
                got = torch.cat([x for _, x in sample_batches(model, sampler, n, lambda lo, hi: cond[lo:hi],
                                                              shape=shape, seed=4, batch_size=batch,
                                                              device=ps.device)])
                if batch >= n:  # the same arithmetic
                    assert torch.equal(got, want), name
                else:  # other batch shapes of the same float32 forwards
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert (want[0] - want[1]).abs().max() > 0.1, "samples of one batch differ"


# ---- d. sample.py -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    """<d>/wan: a wan-debug teacher (1 iteration) on latents [4, 3, 4, 6] with text [5, 16]; <d>/prompts: 3
    prompts of it; <d>/wide: data with text [5, 24]; <d>/digits: a wan-digits teacher on moving digits."""
    d = tmp_path_factory.mktemp("stream")
    g = torch.Generator().manual_seed(0)
    write_shards(str(d / "data"), torch.randn(8, 4, 3, 4, 6, generator=g), cond=torch.randn(8, 5, 16, generator=g))
    write_shards(str(d / "wide"), torch.randn(8, 4, 3, 4, 6, generator=g), cond=torch.randn(8, 5, 24, generator=g))
    write_prompts(str(d / "prompts.safetensors"), torch.randn(3, 5, 16, generator=g), ["a fox", "two cats!", "sea"])
    common = ["--micro-batch-size", "2", "--train-iters", "1", "--log-interval", "1"]
    with world_of_one():
        assert pretrain_flow.main(["--model-size", "wan-debug", "--data", str(d / "data"), "--save", str(d / "wan"),
                                   *common]) == 0
    with world_of_one():
        assert pretrain_flow.main(["--model-size", "wan-digits", "--data", "moving-digits",
                                   "--save", str(d / "digits"), *common]) == 0
    return d


def _sample(argv: list) -> None:
    with world_of_one():
        assert sample_script.main(argv) == 0


@pytest.mark.integration  # moving digits' video media check runs `ffmpeg -version`
def test_sample_npz_does_not_depend_on_the_batch_size(debug_teacher, text_runs, tmp_path):
    d = text_runs
    cases = {"class": ["--load", debug_teacher, "--num-samples", "7", "--steps", "2", "--guidance", "1.5"],
             "prompts": ["--load", str(d / "wan"), "--prompts", str(d / "prompts.safetensors"), "--num-samples", "5",
                         "--steps", "2", "--guidance", "2"],
             "digits": ["--load", str(d / "digits"), "--num-samples", "5", "--steps", "1", "--num-media", "0"]}
    keys = {"class": ["images", "labels"], "prompts": ["images", "labels", "prompts"],
            "digits": ["digits", "directions", "images", "labels"]}
    for name, argv in cases.items():
        _sample(argv + ["--out", str(tmp_path / name / "one")])
        _sample(argv + ["--batch-size", "2", "--out", str(tmp_path / name / "two")])
        one, two = np.load(tmp_path / name / "one" / "samples.npz"), np.load(tmp_path / name / "two" / "samples.npz")
        assert sorted(one.files) == sorted(two.files) == keys[name], name
        for key in one.files:
            assert one[key].dtype == two[key].dtype and one[key].shape == two[key].shape, (name, key)
            if key == "images":
                np.testing.assert_allclose(one[key], two[key], rtol=0, atol=1e-5)
            else:
                assert np.array_equal(one[key], two[key]), (name, key)
    prompts = np.load(tmp_path / "prompts" / "two" / "samples.npz")
    assert list(prompts["prompts"]) == ["a fox", "two cats!", "sea", "a fox", "two cats!"]
    assert list(prompts["labels"]) == [0, 1, 2, 0, 1]
    assert list(np.load(tmp_path / "class" / "two" / "samples.npz")["labels"]) == [0, 1, 2, 3, 4, 5, 6]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _peak_heap(fn) -> int:
    """The most bytes glibc's heap held (in-use chunks + mmapped blocks: torch's and numpy's CPU tensors), polled
    every millisecond while fn() runs, above what it held before."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def held() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    base, stop = held(), threading.Event()
    peak = [base]

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], held())
            time.sleep(0.001)

    t = threading.Thread(target=poll)
    t.start()
    try:
        fn()
    finally:
        stop.set()
        t.join()
    return peak[0] - base


def test_sample_memory_does_not_grow_with_num_samples(debug_teacher, tmp_path):
    def run(n: int, out: str):
        return _peak_heap(lambda: _sample(["--load", debug_teacher, "--num-samples", str(n), "--steps", "1",
                                           "--batch-size", "200", "--out", str(tmp_path / out)]))

    run(1200, "warm")  # first-call caches
    small, large = run(1200, "small"), run(12000, "large")
    one_array = 12000 * 64 * 4  # [N, 1, 8, 8] float32: 3 MB
    assert large - small < one_array / 3, f"peak heap {large / 1e6:.1f} MB at N=12000, {small / 1e6:.1f} MB at 1200"
    got = np.load(tmp_path / "large" / "samples.npz")
    assert got["images"].shape == (12000, 1, 8, 8) and np.array_equal(got["labels"], np.arange(12000) % 10)


def test_sample_data_of_another_condition_width_is_one_line(text_runs, tmp_path, capsys):
    d = text_runs
    for data, needles in ((d / "wide", ["holds text embeddings [5, 24] (width 24)", "takes [5, 16] (width 16)"]),
                          ("digits", ["holds class labels (10 classes)", "takes text embeddings [5, 16] (width 16)"])):
        with world_of_one():
            rc = sample_script.main(["--load", str(d / "wan"), "--data", str(data), "--num-samples", "2",
                                     "--steps", "1", "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and err[0].startswith(f"DataError: --data {data} "), err
        assert all(s in err[0] for s in needles + [f"--load {d / 'wan'}"]), err[0]
        assert not (tmp_path / "out").exists()
