"""Decoded media: `dmd2_mega/eval/media.py`, `launch/sample.py --vae / --prompts` and the trainers' eval media.

  a. Clips: MP4 (H.264) and GIF read back with imageio have the clip's frame count and the documented size
     (an 8x8 grey clip -> 128x128, 13x21 RGB -> 130x210, 129x131 -> MP4 130x132 (even sides) / GIF 129x131);
     grey GIF frames equal the nearest-neighbour upscale of the uint8 pixels, the MP4's are within H.264's
     error of them; no temporary file is left. A PNG image equals the uint8 rule upscaled. Names are unique.
  b. A missing imageio-ffmpeg is a ConfigError naming the package (media.py, and sample.py before any work).
  c. TensorBoard: `TrainLogger.media` stores a GIF as an image summary holding the file's bytes (what
     add_video would store, without moviepy) and a PNG through add_image; EventAccumulator reads both back.
  d. wan-debug end to end on a tiny random diffusers AutoencoderKLWan (z_dim 4) saved here: pretrain_flow.py
     with --eval-interval 1 --eval-prompts --vae --tensorboard-dir writes media/iter_0000001/<prompt>.mp4 + .gif
     and their video summaries; sample.py --prompts --vae of that teacher: the frames it decodes equal diffusers'
     `AutoencoderKLWan.decode` of the un-normalised latents in samples.npz (x = z * std + mean, the independent
     reference), and its MP4 / GIF have as many frames as the decode; the DMD2 student's eval writes the same
     media. --prompts' negative is CFG's negative (a file without one samples as a zero one). Also: moving-digits
     pixel clips get MP4 + GIF without a VAE (the grey GIF equals the samples exactly), and class-conditional
     image latents decoded by a tiny AutoencoderKL give PNGs and a decoded grid.png equal to diffusers' decode.
  e. Start-up checks: a VAE with other latent channels fails naming --vae (sample.py: nothing written; the
     trainer: before any iteration), --eval-prompts of another embedding width names --eval-prompts, a video
     VAE for image latents (and the reverse) is refused, --vae / --eval-prompts need --eval-interval.
"""
import io
import json
import os
import sys
import warnings

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image

from dmd2_mega.arguments import parse_flow_args
from dmd2_mega.data import write_shards
from dmd2_mega.data.prompts import write_prompts
from dmd2_mega.errors import ConfigError, EvalInputError
from dmd2_mega.eval import media
from dmd2_mega.train.logger import TrainLogger
from dmd2_mega.prep.vae import LatentVAE, StreamDecoder, VAESpec
from launch import pretrain_dmd2, pretrain_flow
from launch import sample as sample_script
from tests.utils import find_tmp, world_of_one

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("wan_run",)  # they encode media with ffmpeg, a process
TEXTS = ["A red fox runs", "two cats!"]
TB_IMAGES = {"images": 0}  # EventAccumulator: keep every image event


def upscaled(clip: torch.Tensor, u: int) -> np.ndarray:
    """Independent reference: [T, C, H, W] in [-1, 1] -> uint8 [T, H u, W u, C] by plain numpy."""
    x = np.clip(np.round((clip.numpy().astype(np.float64) + 1) * 127.5), 0, 255).astype(np.uint8)
    return np.kron(x.transpose(0, 2, 3, 1), np.ones((1, u, u, 1), dtype=np.uint8))


def frames(path: str) -> np.ndarray:
    """[T, H, W, 3] uint8 read back with imageio."""
    out = iio.imread(path, index=None)
    return out if out.ndim == 4 else out[..., None].repeat(3, axis=3)


def smooth_clip(t: int, c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """A clip that H.264 keeps close: a random colour ramp per frame, in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    a = torch.rand(t, c, 1, 1, generator=g) - 0.5
    return ((yy + xx) * a + 0.3 * torch.rand(t, c, 1, 1, generator=g) - 0.15).clamp(-1, 1)


# ---- a. clips, images, names --------------------------------------------------------------------

@pytest.mark.parametrize("t,c,h,w,u,mp4_size", [
    (4, 1, 8, 8, 16, (128, 128)),      # tiny grey digits: upscaled x16
    (5, 3, 13, 21, 10, (130, 210)),    # odd sides, upscaled to even ones
    (2, 3, 129, 131, 1, (130, 132)),   # large enough: no upscale, the MP4 pads to even sides
], ids=["T4-grey-8x8", "T5-rgb-13x21", "T2-rgb-129x131"])
@pytest.mark.integration
def test_mp4_and_gif_read_back(tmp_path, t, c, h, w, u, mp4_size):
    assert media.viewable_scale(h, w) == u
    clip = smooth_clip(t, c, h, w)
    mp4, gif = media.write_mp4(tmp_path / "a.mp4", clip), media.write_gif(tmp_path / "a.gif", clip)
    ref = upscaled(clip, u)
    if c == 1:
        ref = ref.repeat(3, axis=3)
    got_gif, got_mp4 = frames(gif), frames(mp4)
    assert got_gif.shape == (t, h * u, w * u, 3), got_gif.shape
    assert got_mp4.shape == (t, *mp4_size, 3), got_mp4.shape
    if c == 1:  # a grey GIF is exact
        assert np.array_equal(got_gif, ref)
    else:  # RGB GIFs are palette-quantised
        assert np.abs(got_gif.astype(int) - ref).mean() < 4
    err = np.abs(got_mp4[:, :h * u, :w * u].astype(int) - ref).mean()
    assert err < 4, f"MP4 mean abs error {err:.2f} / 255"
    assert not find_tmp(str(tmp_path))


def test_png_image_and_names(tmp_path):
    img = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(1)) * 2.2 - 1.1  # some pixels clip
    got = np.asarray(Image.open(media.write_png(tmp_path / "i.png", img)))
    assert np.array_equal(got, upscaled(img[None], 26)[0])  # ceil(128 / 5) = 26
    files, kept = media.write_samples(str(tmp_path / "m"), torch.stack([img, -img]), media.media_names(2))
    assert sorted(os.listdir(tmp_path / "m")) == ["000.png", "001.png"] and kept == []
    assert files.shown == {"000": str(tmp_path / "m" / "000.png"), "001": str(tmp_path / "m" / "001.png")}
    assert media.media_names(3, ["a", "b"]) == ["a_0", "b_0", "a_1"]
    assert media.media_names(2, ["a", "b"]) == ["a", "b"]
    with pytest.raises(EvalInputError, match=r"C = 1 \(grey\) or 3"):
        media.write_gif(tmp_path / "bad.gif", torch.zeros(2, 4, 8, 8))


# ---- b. no silent fallback without ffmpeg --------------------------------------------------------

def test_missing_ffmpeg_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # `import imageio_ffmpeg` raises ImportError
    with pytest.raises(ConfigError, match="imageio-ffmpeg"):
        media.write_mp4(tmp_path / "a.mp4", torch.zeros(2, 1, 8, 8))
    assert not os.listdir(tmp_path)


# ---- c. TensorBoard -------------------------------------------------------------------------------

def events(tb_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(tb_dir, size_guidance=TB_IMAGES)
    acc.Reload()
    return acc


def test_tensorboard_video_and_image(tmp_path):
    gif = media.write_gif(tmp_path / "clip.gif", smooth_clip(3, 1, 8, 8))
    png = media.write_png(tmp_path / "img.png", torch.zeros(3, 8, 16))
    logger = TrainLogger(0, 10, tensorboard_dir=str(tmp_path / "tb"))
    logger.media(7, {"clip": gif, "img": png})
    logger.close()
    acc = events(str(tmp_path / "tb"))
    assert set(acc.Tags()["images"]) == {"eval/clip", "eval/img"}
    (video,), (image,) = acc.Images("eval/clip"), acc.Images("eval/img")
    assert video.step == 7 and video.encoded_image_string == open(gif, "rb").read()
    assert (video.width, video.height) == (128, 128)
    assert (image.width, image.height) == (256, 128)  # 8x16 upscaled x16
    assert np.asarray(Image.open(io.BytesIO(image.encoded_image_string))).max() == 128


# ---- d. wan-debug end to end -----------------------------------------------------------------------

def save_tiny_wan_vae(path: str, z_dim: int = 4, seed: int = 0) -> str:
    from diffusers import AutoencoderKLWan
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vae = AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                               latents_mean=[0.3 * (i - 1) for i in range(z_dim)],
                               latents_std=[0.5 + 0.4 * i for i in range(z_dim)])
    vae.save_pretrained(path)
    return path


def flow_argv(d, **over) -> list:
    a = {"--model-size": "wan-debug", "--data": f"{d}/data", "--micro-batch-size": "2", "--train-iters": "1",
         "--log-interval": "1", "--eval-interval": "1", "--eval-steps": "2", "--eval-guidance": "2",
         "--eval-prompts": f"{d}/prompts.safetensors", "--vae": f"{d}/vae", "--seed": "3", "--save": f"{d}/teacher",
         "--tensorboard-dir": f"{d}/tb", **over}
    return [x for k, v in a.items() if v is not None for x in (k, v)]


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """A wan-debug teacher trained 1 iteration on random latents [4, 3, 4, 6] with text [5, 16], evaluated
    with 2 prompts, decoded by a tiny Wan VAE (z_dim 4: 9 frames of 32x48 per sample)."""
    d = str(tmp_path_factory.mktemp("media"))
    g = torch.Generator().manual_seed(0)
    write_shards(f"{d}/data", torch.randn(8, 4, 3, 4, 6, generator=g), cond=torch.randn(8, 5, 16, generator=g))
    write_prompts(f"{d}/prompts.safetensors", torch.randn(2, 5, 16, generator=g), TEXTS,
                  negative=torch.randn(5, 16, generator=g))
    save_tiny_wan_vae(f"{d}/vae")
    with world_of_one():
        rc = pretrain_flow.main(flow_argv(d))
    assert rc == 0
    return d


NAMES = ["000_a-red-fox-runs", "001_two-cats"]


def check_eval_media(save: str, tb: str) -> None:
    """<save>/media/iter_0000001 holds an MP4 (9 frames of 32x48, x4) + GIF per prompt, and TensorBoard the GIFs."""
    root = os.path.join(save, "media", "iter_0000001")
    assert sorted(os.listdir(root)) == sorted(n + e for n in NAMES for e in (".gif", ".mp4"))
    for n in NAMES:
        assert frames(os.path.join(root, n + ".mp4")).shape == (9, 128, 192, 3)  # 1 + 4 (3 - 1) frames, x4
    acc = events(tb)
    for n in NAMES:
        (ev,) = acc.Images(f"eval/{n}")
        assert ev.step == 1 and ev.encoded_image_string == open(os.path.join(root, n + ".gif"), "rb").read()


@pytest.mark.integration
def test_teacher_eval_writes_media_and_video_summaries(wan_run):
    check_eval_media(f"{wan_run}/teacher", f"{wan_run}/tb")
    assert os.path.isfile(f"{wan_run}/teacher/samples/iter_0000001.png")  # the latent grid as before


@pytest.mark.integration
def test_student_eval_writes_media_and_video_summaries(wan_run, tmp_path):
    d, save = wan_run, str(tmp_path / "student")
    argv = flow_argv(d, **{"--save": save, "--tensorboard-dir": str(tmp_path / "tb"), "--eval-guidance": None,
                           "--eval-steps": None})
    with world_of_one():
        rc = pretrain_dmd2.main(argv + ["--teacher-load", f"{d}/teacher", "--global-batch-size", "2",
                                        "--dmd2-critic-steps-per-rollout", "1", "--dmd2-denoising-steps", "2"])
    assert rc == 0
    check_eval_media(save, str(tmp_path / "tb"))
    assert os.path.isfile(f"{save}/samples/cycle_0000001.png")


@pytest.mark.integration
def test_sample_vae_decodes_like_diffusers(wan_run, tmp_path, monkeypatch):
    from diffusers import AutoencoderKLWan
    d, out = wan_run, str(tmp_path / "out")
    got = []
    decode = LatentVAE.decode
    monkeypatch.setattr(LatentVAE, "decode", lambda self, z: got.append(decode(self, z)) or got[-1])
    with world_of_one():
        rc = sample_script.main(["--load", f"{d}/teacher", "--prompts", f"{d}/prompts.safetensors", "--vae",
                                 f"{d}/vae", "--steps", "2", "--guidance", "2", "--out", out])
    assert rc == 0
    npz = np.load(os.path.join(out, "samples.npz"))
    assert list(npz["prompts"]) == TEXTS and list(npz["labels"]) == [0, 1]
    z = torch.from_numpy(npz["images"])  # normalised latents [2, 4, 3, 4, 6]
    config = json.load(open(f"{d}/vae/config.json"))
    view = (1, -1, 1, 1, 1)
    raw = z * torch.tensor(config["latents_std"]).view(view) + torch.tensor(config["latents_mean"]).view(view)
    with torch.no_grad():
        ref = AutoencoderKLWan.from_pretrained(f"{d}/vae").eval().decode(raw).sample.clamp(-1, 1)
    assert ref.shape == (2, 3, 9, 32, 48)
    ours = torch.cat(got)
    assert ours.shape == ref.shape and torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    for i, name in enumerate(NAMES):
        want = upscaled(ref[i].transpose(0, 1), 4)  # [9, 128, 192, 3]
        for ext in (".mp4", ".gif"):  # ~2.6 / 255 from H.264 / the palette; the other sample is ~13 away
            f = frames(os.path.join(out, "media", name + ext))
            assert f.shape == want.shape, (ext, f.shape)
            assert np.abs(f.astype(int) - want).mean() < 6, ext


@pytest.mark.integration
def test_sample_stream_decodes_each_chunk_as_it_comes(wan_run, tmp_path, monkeypatch):
    """sample.py --stream --vae on a causal wan-debug (chunks of 1 latent frame): each chunk's frames are decoded and
    written as the chunk comes (<out>/stream/<i>/frame_NNNNN.png) with the Wan VAE's causal cache kept between
    chunks, so the chunks give 1 + 4 + 4 frames and together are the whole clip's decode (as the media's MP4)."""
    d, save, out = wan_run, str(tmp_path / "causal"), str(tmp_path / "out")
    with world_of_one():
        argv = flow_argv(d, **{"--save": save, "--tensorboard-dir": None, "--eval-interval": None,
                               "--eval-prompts": None, "--vae": None, "--eval-steps": None, "--eval-guidance": None})
        assert pretrain_flow.main(argv + ["--causal", "--causal-chunk-frames", "1"]) == 0
    chunks, whole = [], []
    stream_decode, decode = StreamDecoder.decode, LatentVAE.decode
    monkeypatch.setattr(StreamDecoder, "decode", lambda self, z: chunks.append(stream_decode(self, z)) or chunks[-1])
    monkeypatch.setattr(LatentVAE, "decode", lambda self, z: whole.append(decode(self, z)) or whole[-1])
    with world_of_one():
        assert sample_script.main(["--load", save, "--prompts", f"{d}/prompts.safetensors", "--vae", f"{d}/vae",
                                   "--stream", "--steps", "2", "--out", out]) == 0
    for i in range(2):
        names = sorted(os.listdir(os.path.join(out, "stream", f"{i:03d}")))
        assert names == [f"frame_{t:05d}.png" for t in range(9)], names
    assert [c.shape[2] for c in chunks] == [1, 4, 4] and all(c.shape[:2] == (2, 3) for c in chunks)
    streamed = torch.cat(chunks, 2)  # [2 samples, 3, 9, 32, 48]
    assert len(whole) == 2 and whole[0].shape == (1, 3, 9, 32, 48)
    assert torch.allclose(streamed, torch.cat(whole), atol=1e-5, rtol=0), (streamed - torch.cat(whole)).abs().max()


def test_sample_prompts_negative_is_cfg_negative(wan_run, tmp_path):
    """With guidance 2 the stored negative steers the samples; a file without one samples as with a zero one (the
    negative of this model's data), and latents without --vae get samples.npz + grid.png (and timing.json) only, as
    before."""
    d, g = wan_run, torch.Generator().manual_seed(4)
    cond, neg = torch.randn(2, 5, 16, generator=g), torch.randn(5, 16, generator=g)
    runs = {}
    for name, negative in (("neg", neg), ("none", None), ("zero", torch.zeros(5, 16))):
        write_prompts(str(tmp_path / f"{name}.safetensors"), cond, TEXTS, negative=negative)
        with world_of_one():
            rc = sample_script.main(["--load", f"{d}/teacher", "--prompts", str(tmp_path / f"{name}.safetensors"),
                                     "--steps", "2", "--guidance", "2", "--out", str(tmp_path / name)])
        assert rc == 0
        runs[name] = np.load(tmp_path / name / "samples.npz")["images"]
    assert sorted(os.listdir(tmp_path / "none")) == ["grid.png", "samples.npz", "timing.json"]
    assert np.array_equal(runs["none"], runs["zero"])
    assert np.abs(runs["neg"] - runs["none"]).max() > 1e-3


@pytest.mark.integration
def test_sample_pixel_video_gets_media_without_vae(tmp_path):
    """--data moving-digits (1-channel pixel clips [1, 4, 16, 16]): sample.py writes an MP4 + GIF for each of the
    first --num-media samples with no VAE, named by the (digit, direction) prompt; the grey GIF's frames are exactly
    the samples' pixels upscaled x8 (ceil(128 / 16))."""
    d = str(tmp_path)
    with world_of_one():
        assert pretrain_flow.main(["--model-size", "wan-digits", "--data", "moving-digits", "--micro-batch-size", "2",
                                   "--train-iters", "1", "--log-interval", "1", "--save", f"{d}/t"]) == 0
    with world_of_one():
        assert sample_script.main(["--load", f"{d}/t", "--num-samples", "3", "--num-media", "2", "--steps", "1",
                                   "--out", f"{d}/s"]) == 0
    images = torch.from_numpy(np.load(f"{d}/s/samples.npz")["images"])
    names = ["000_0_right", "001_1_right"]  # samples cycle through digit k % 10, direction k // 10
    assert sorted(os.listdir(f"{d}/s/media")) == sorted(f"{n}.{e}" for n in names for e in ("gif", "mp4"))
    for i, n in enumerate(names):
        want = upscaled(images[i].transpose(0, 1), 8).repeat(3, axis=3)  # [4, 128, 128, 3]
        assert np.array_equal(frames(f"{d}/s/media/{n}.gif"), want)
        assert frames(f"{d}/s/media/{n}.mp4").shape == want.shape


def kl_latent_teacher(d: str, classes: int) -> None:
    """<d>/kl: a tiny AutoencoderKL (scaling 0.5, x2 spatial); <d>/data: 8 random latents [4, 8, 8] with labels
    i % classes; <d>/t: a debug DiT teacher trained one step on them."""
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                  scaling_factor=0.5).save_pretrained(f"{d}/kl")
    write_shards(f"{d}/data", torch.randn(8, 4, 8, 8, generator=torch.Generator().manual_seed(1)),
                 labels=torch.arange(8) % classes)
    with world_of_one():
        assert pretrain_flow.main(["--model-size", "debug", "--data", f"{d}/data", "--micro-batch-size", "2",
                                   "--train-iters", "1", "--log-interval", "1", "--save", f"{d}/t"]) == 0


def test_sample_vae_decodes_images_to_pngs_and_grid(tmp_path):
    """Class-conditional image latents [4, 8, 8] with a tiny AutoencoderKL (scaling 0.5, x2 spatial): sample.py --vae
    writes <i>.png per sample equal to diffusers' decode of latents / 0.5 (PNG is lossless; x8 upscale of 16x16),
    and grid.png shows the decoded images, one row per class."""
    from diffusers import AutoencoderKL
    d = str(tmp_path)
    kl_latent_teacher(d, classes=2)
    with world_of_one():
        assert sample_script.main(["--load", f"{d}/t", "--num-samples", "3", "--steps", "1", "--vae", f"{d}/kl",
                                   "--out", f"{d}/s"]) == 0
    z = torch.from_numpy(np.load(f"{d}/s/samples.npz")["images"])
    with torch.no_grad():
        ref = AutoencoderKL.from_pretrained(f"{d}/kl").eval().decode(z / 0.5).sample.clamp(-1, 1)
    assert sorted(os.listdir(f"{d}/s/media")) == ["000.png", "001.png", "002.png"]
    for i in range(3):
        got = np.asarray(Image.open(f"{d}/s/media/{i:03d}.png")).astype(int)
        assert np.abs(got - upscaled(ref[i:i + 1], 8)[0]).max() <= 1  # float32 vs float64 rounding at .5
    grid = np.asarray(Image.open(f"{d}/s/grid.png")).astype(int)  # labels 0 1 0: rows 0 = (0, 2), 1 = (1, -)
    assert grid.shape == (256, 256, 3)
    assert np.abs(grid[128:, :128] - upscaled(ref[1:2], 8)[0]).max() <= 1 and grid[128:, 128:].max() == 0


# ---- e. start-up checks ----------------------------------------------------------------------------

def test_vae_of_other_channels_fails_up_front(wan_run, tmp_path, capsys):
    d = wan_run
    vae8 = save_tiny_wan_vae(str(tmp_path / "vae8"), z_dim=8)
    with world_of_one():
        rc = sample_script.main(["--load", f"{d}/teacher", "--prompts", f"{d}/prompts.safetensors", "--vae", vae8,
                                 "--steps", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith(f"ConfigError: --vae {vae8}: the VAE's latents have 8 channels, but the "
                                      f"model's have 4"), err
    assert not os.path.exists(tmp_path / "out")
    with world_of_one():
        rc = pretrain_flow.main(flow_argv(d, **{"--vae": vae8, "--save": str(tmp_path / "t"),
                                                "--tensorboard-dir": None}))
    out, err = capsys.readouterr()
    assert rc == 1 and err.startswith(f"ConfigError: --vae {vae8}: the VAE's latents have 8 channels"), err
    assert " iteration " not in out and not os.path.exists(tmp_path / "t" / "latest_checkpointed_iteration.txt")


def test_eval_prompts_of_another_width_fail_up_front(wan_run, tmp_path, capsys):
    d, bad = wan_run, str(tmp_path / "p.safetensors")
    write_prompts(bad, torch.zeros(2, 5, 8), TEXTS)
    with world_of_one():
        rc = pretrain_flow.main(flow_argv(d, **{"--eval-prompts": bad, "--save": None, "--tensorboard-dir": None}))
    out, err = capsys.readouterr()
    assert rc == 1 and err.startswith(f"DataError: --eval-prompts {bad}: embeddings are [5, 8] per prompt, but the "
                                      f"model takes [5, 16]"), err
    assert " iteration " not in out


def test_sample_without_ffmpeg_fails_before_work(wan_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    d = wan_run
    with world_of_one():
        rc = sample_script.main(["--load", f"{d}/teacher", "--prompts", f"{d}/prompts.safetensors", "--vae",
                                 f"{d}/vae", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith(f"ConfigError: --vae {d}/vae writes MP4") and "imageio-ffmpeg" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_vae_kind_must_fit_the_latents(tmp_path):
    kl = tmp_path / "kl"
    kl.mkdir()
    (kl / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "latent_channels": 4,
                                                "block_out_channels": [8, 8]}))
    spec = VAESpec.from_folder(str(kl))
    media.check_vae(spec, (4, 8, 8), "--vae kl")  # an image VAE for image latents
    with pytest.raises(ConfigError, match=r"--vae kl: a 'kl' VAE cannot decode the model's video latents"):
        media.check_vae(spec, (4, 3, 8, 8), "--vae kl")
    with pytest.raises(ConfigError, match="--vae x: the VAE's latents have 4 channels, but the model's have 16"):
        media.check_vae(spec, (16, 8, 8), "--vae x")
    with pytest.raises(ConfigError, match="--vae v is used by the eval only; give --eval-interval N"):
        parse_flow_args(["--vae", "v"])
    with pytest.raises(ConfigError, match="--eval-prompts p is used by the eval only"):
        parse_flow_args(["--eval-prompts", "p"])
