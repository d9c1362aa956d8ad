"""launch/prepare_data.py with image-to-video Wan pipeline folders (dmd2_mega/prep/image.py), against diffusers'
WanImageToVideoPipeline called directly.

Two tiny random pipeline folders are built here and saved with save_pretrained (nothing is downloaded): "i2v", Wan
2.1 I2V's layout (a WanTransformer3DModel with in_channels 2 x 4 + 4, image_dim 32, a CLIPVisionModel of hidden 32
at 28 px with patch 14 -> CLIP [5, 32], its CLIPImageProcessor, an AutoencoderKLWan z_dim 4, a UMT5 d_model 16 with
a WordLevel tokenizer), and "ti2v", Wan 2.2 TI2V's image mode (expand_timesteps true, a text-to-video transformer,
no CLIP). Media: lossless-read GIFs of random frames, 16 x 24 (h x w: --height 16 --width 16 crops columns 4:20, no
resize), and PNGs. Checks, fp32, within 1e-5 (the same arithmetic up to pixel scaling x / 127.5 - 1 vs 2 x / 255 - 1):
  * concat: each shard row's image part == WanImageToVideoPipeline.prepare_latents(first frame)'s condition[:, 4:],
    whose [:, :4] == models/wan/image.concat_mask; its CLIP part == pipe.encode_image(first frame); its text part ==
    pipe.encode_prompt; load_shards reads the set with its cond_parts and the text-only negative; a re-run keeps
    every shard, and the other form on the same --out is refused naming image_condition.
  * first-frame: the image part [4, 1, 2, 2] == the expand_timesteps pipeline's latent condition.
  * --prompts-only --images: read_prompts reads cond [P, N], its parts, image paths and the [L, D] negative; the
    values equal the pipeline's; a file read against other parts is refused.
  * errors, each one line before any model loads: a transformer with image_dim and no image encoder, a contradicting
    --image-condition, a folder contradicting itself, --image-condition concat for a text-to-video transformer, CLIP
    for the first-frame form, --prompts for an I2V model, an --images row naming a missing image (file and line).
"""
import contextlib
import io
import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from dmd2_mega.data import load_shards
from dmd2_mega.data.prompts import read_prompts
from dmd2_mega.errors import DataError
from dmd2_mega.prep.text import DEFAULT_NEGATIVE
from launch import prepare_data
from tests.utils import tiny_clip_parts, tiny_wan_pipeline_parts

pytestmark = pytest.mark.timeout(120)
WORDS = ["a", "cat", "dog", "runs", "red", "ball", "sky"]
L, D, C = 6, 16, 4              # --max-text-len, UMT5 d_model, latent channels
CLIP = (5, 32)                  # (28 / 14)^2 + 1 tokens, hidden 32
LATENT = (C, 2, 2, 2)           # --frames 5 --height 16 --width 16
CAPTIONS = {"a.gif": "a cat runs", "b.gif": "a red ball", "c.gif": "dog sky"}
SIZE = ["--frames", "5", "--height", "16", "--width", "16", "--max-text-len", str(L), "--dtype", "fp32",
        "--workers", "0"]


def _pipeline(folder, expand: bool, seed: int) -> None:
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    torch.manual_seed(seed)
    i2v = {} if expand else dict(in_channels=2 * C + 4, image_dim=CLIP[1], added_kv_proj_dim=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = WanTransformer3DModel(**{**dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=C, out_channels=C,
            text_dim=D, freq_dim=16, ffn_dim=32, num_layers=1), **i2v})
        WanImageToVideoPipeline(transformer=transformer, expand_timesteps=expand,
                                **({} if expand else tiny_clip_parts(CLIP[1])),
                                **tiny_wan_pipeline_parts(WORDS, latents_mean=[0.1, -0.2, 0.3, 0.0],
                                                          latents_std=[0.5, 2.0, 1.5, 1.0])).save_pretrained(folder)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep_i2v")
    _pipeline(d / "i2v", expand=False, seed=0)
    _pipeline(d / "ti2v", expand=True, seed=1)
    rng = np.random.default_rng(0)
    media = d / "media"
    media.mkdir()
    for name in CAPTIONS:  # 6 random frames, 16 x 24
        frames = [Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)) for _ in range(6)]
        frames[0].save(media / name, save_all=True, append_images=frames[1:], duration=100, loop=0)
    for name in ("p.png", "q.png"):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(media / name)
    (d / "captions.jsonl").write_text("".join(json.dumps({"path": p, "caption": c}) + "\n"
                                              for p, c in reversed(CAPTIONS.items())))
    return d


def _run(argv) -> tuple:
    """prepare_data.run(argv) in process: (exit status, stdout, stderr lines)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = prepare_data.run([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue().strip().splitlines()


def _shard_args(d, pipe: str, out):
    return ["--pipeline", d / pipe, "--media", d / "media", "--captions", d / "captions.jsonl", "--out", out,
            "--shard-size", "2", "--batch-size", "2", *SIZE]


@pytest.fixture(scope="module")
def concat_run(made):
    out = made / "concat_out"
    rc, printed, err = _run(_shard_args(made, "i2v", out))
    assert rc == 0, err
    return out, printed


def _pipe(folder):
    from diffusers import WanImageToVideoPipeline
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return WanImageToVideoPipeline.from_pretrained(folder)


def _first_frame(path) -> Image.Image:
    """The clip's first frame as prepare_data takes it, read independently: Pillow, columns 4:20 of 24."""
    with Image.open(path) as im:
        im.seek(0)
        return Image.fromarray(np.asarray(im.convert("RGB"))[:, 4:20].copy())


def _reference(pipe, first: Image.Image, prompt: str) -> dict:
    """WanImageToVideoPipeline's conditions of one image and prompt at 5 frames of 16 x 16 (fp32, CPU)."""
    cpu = torch.device("cpu")
    image = pipe.video_processor.preprocess(first, height=16, width=16).to(cpu, torch.float32)
    with torch.no_grad():
        cond = pipe.prepare_latents(image, 1, C, 16, 16, 5, torch.float32, cpu)[1]
        text, neg = pipe.encode_prompt(prompt, negative_prompt=DEFAULT_NEGATIVE, max_sequence_length=L,
                                       device=cpu, dtype=torch.float32)
        clip = pipe.encode_image(first, cpu) if pipe.image_encoder is not None else None
    return {"cond": cond[0], "text": text[0], "negative": neg[0], "clip": None if clip is None else clip[0]}


def _unpack(row: torch.Tensor, parts) -> dict:
    sizes = [int(np.prod(s)) for _, s in parts]
    return {name: piece.view(*shape) for (name, shape), piece in zip(parts, row.split(sizes))}


def _rows(out) -> dict:
    """{clip path: cond row} over the shards, in the order the shards wrote them."""
    from safetensors import safe_open
    rows = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("shard_") and name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), framework="pt") as f:
                rows.update(zip(json.loads(f.metadata()["written"]), f.get_tensor("cond")))
    return rows


def test_concat_shards_match_the_i2v_pipeline(made, concat_run):
    from dmd2_mega.models.wan.image import concat_mask
    out, printed = concat_run
    parts = (("text", (L, D)), ("clip", CLIP), ("image", LATENT))
    index = json.loads((out / "index.json").read_text())
    assert index["cond_parts"] == [[n, list(s)] for n, s in parts] and index["cond_shape"] == [L * D + 160 + 32]
    assert "image condition: concat (transformer in_channels 12 = 2 x 4 + 4), CLIP [5, 32] from " in printed
    ds = load_shards(str(out))
    assert ds.cond_parts == parts and tuple(ds.negative.shape) == (L, D) and len(ds) == 3
    pipe, rows = _pipe(made / "i2v"), _rows(out)
    assert sorted(rows) == sorted(CAPTIONS)
    for name, caption in CAPTIONS.items():
        got, want = _unpack(rows[name], parts), _reference(pipe, _first_frame(made / "media" / name), caption)
        assert want["cond"].shape == (2 * C, *LATENT[1:])
        torch.testing.assert_close(got["image"], want["cond"][C:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(concat_mask(got["image"][None], 4)[0], want["cond"][:C], atol=0, rtol=0)
        torch.testing.assert_close(got["clip"], want["clip"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["text"], want["text"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ds.negative, want["negative"], atol=1e-5, rtol=1e-5)
    _, cond = ds.get_batch(torch.tensor([0]))  # the load_shards rows are the shard rows (sorted paths: a.gif first)
    torch.testing.assert_close(cond[0], rows["a.gif"])


def test_rerun_keeps_the_shards_and_the_other_form_is_refused(made, concat_run):
    out, _ = concat_run
    rc, printed, err = _run(_shard_args(made, "i2v", out))
    assert rc == 0 and "(2 kept from an earlier run)" in printed, (err, printed)
    rc, _, err = _run(_shard_args(made, "ti2v", out))
    assert rc == 1 and len(err) == 1 and err[0].startswith("DataError: --out ")
    assert "image_condition 'concat' -> 'first-frame'" in err[0]


def test_first_frame_shards_match_the_ti2v_pipeline(made, tmp_path):
    out = tmp_path / "ff"
    rc, printed, err = _run(_shard_args(made, "ti2v", out))
    assert rc == 0, err
    assert "image condition: first-frame (model_index.json: WanImageToVideoPipeline, expand_timesteps true, " \
           "transformer in_channels 4 = out_channels), no CLIP embedding" in printed
    parts = (("text", (L, D)), ("image", (C, 1, 2, 2)))
    assert load_shards(str(out)).cond_parts == parts
    pipe = _pipe(made / "ti2v")
    for name, row in _rows(out).items():
        got, want = _unpack(row, parts), _reference(pipe, _first_frame(made / "media" / name), CAPTIONS[name])
        assert want["clip"] is None and want["cond"].shape == (C, 1, 2, 2)
        torch.testing.assert_close(got["image"], want["cond"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["text"], want["text"], atol=1e-5, rtol=1e-5)


def test_prompts_only_with_images(made, tmp_path):
    shutil.copy(made / "media" / "p.png", tmp_path / "p.png")
    images = tmp_path / "eval.csv"  # paths relative to the file's folder; an image may repeat
    images.write_text(f"path,caption\np.png,a cat runs\n{made / 'media' / 'b.gif'},dog sky\np.png,red ball\n")
    out = tmp_path / "eval.safetensors"
    rc, printed, err = _run(["--prompts-only", "--pipeline", made / "i2v", "--images", images, "--out", out,
                             "--negative-prompt", "sky", *SIZE])
    assert rc == 0, err
    assert "3 image prompts" in printed and "image condition: concat" in printed
    n = L * D + 160 + 32
    p = read_prompts(str(out), cond_shape=(n,), flag="--prompts")
    parts = (("text", (L, D)), ("clip", CLIP), ("image", LATENT))
    assert p.texts == ["a cat runs", "dog sky", "red ball"] and p.cond_parts == parts
    assert p.images == ["p.png", str(made / "media" / "b.gif"), "p.png"] and p.negative.shape == (L, D)
    pipe = _pipe(made / "i2v")
    for i, first in ((0, Image.open(tmp_path / "p.png").convert("RGB")), (1, _first_frame(made / "media" / "b.gif"))):
        got, want = _unpack(p.cond[i], parts), _reference(pipe, first, p.texts[i])
        torch.testing.assert_close(got["image"], want["cond"][C:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["clip"], want["clip"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["text"], want["text"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_unpack(p.cond[2], parts)["image"], _unpack(p.cond[0], parts)["image"])
    with pytest.raises(DataError, match=r"parts are .* but the model takes \[\['text', \[6, 16\]\], \['image'"):
        read_prompts(str(out), cond_shape=(n,), cond_parts=(("text", (L, D)), ("image", (n - L * D,))))


def _variant(made, name: str, base: str, index: dict = None, transformer: dict = None, drop=()) -> str:
    """A config-only copy of pipeline `base` (model_index.json and transformer/config.json edited, the model folders
    linked, those in `drop` left out)."""
    src, dst = made / base, made / name
    if dst.exists():
        return str(dst)
    dst.mkdir()
    meta = {**json.loads((src / "model_index.json").read_text()), **(index or {})}
    for sub in drop:
        meta[sub] = [None, None]
    (dst / "model_index.json").write_text(json.dumps(meta))
    (dst / "transformer").mkdir()
    cfg = {**json.loads((src / "transformer" / "config.json").read_text()), **(transformer or {})}
    (dst / "transformer" / "config.json").write_text(json.dumps(cfg))
    for sub in ("vae", "text_encoder", "tokenizer", "image_encoder", "image_processor"):
        if (src / sub).exists() and sub not in drop:
            os.symlink(src / sub, dst / sub)
    return str(dst)


@pytest.mark.parametrize("case", ["no-image-encoder", "contradicting-flag", "folder-contradicts", "concat-on-t2v",
                                  "clip-first-frame", "prompts-for-i2v", "missing-image"])
def test_errors_are_one_line_before_any_model_loads(made, tmp_path, monkeypatch, case):
    from dmd2_mega.prep import image as prep_image, run as prep_run

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")
    for where, obj in ((prep_run, "LatentVAE"), (prep_run, "TextEncoder"), (prep_image, "ImageConditioner")):
        monkeypatch.setattr(getattr(where, obj), "load" if obj == "ImageConditioner" else "from_folder", loaded)
    out = tmp_path / "out"
    shards = ["--media", made / "media", "--captions", made / "captions.jsonl", "--out", out, *SIZE]
    if case == "no-image-encoder":
        argv = ["--pipeline", _variant(made, "noclip", "i2v", drop=("image_encoder", "image_processor")), *shards]
        want = "ConfigError: --image-encoder: the pipeline's transformer/config.json has image_dim 32"
    elif case == "contradicting-flag":
        argv = ["--pipeline", made / "i2v", "--image-condition", "first-frame", *shards]
        want = (f"ConfigError: --image-condition first-frame: --pipeline {made / 'i2v'} reads the concat form "
                f"(transformer in_channels 12 = 2 x 4 + 4)")
    elif case == "folder-contradicts":
        argv = ["--pipeline", _variant(made, "bad", "i2v", index={"expand_timesteps": True}), *shards]
        want = "ConfigError: --pipeline"
    elif case == "concat-on-t2v":
        t2v = _variant(made, "t2v", "ti2v", index={"_class_name": "WanPipeline", "expand_timesteps": False})
        argv = ["--pipeline", t2v, "--image-condition", "concat", *shards]
        want = (f"ConfigError: --image-condition concat: --pipeline {t2v} has transformer in_channels 4 = "
                f"out_channels; the concat form needs in_channels = 2 x 4 + 4")
    elif case == "clip-first-frame":
        argv = ["--pipeline", made / "ti2v", "--image-encoder", made / "i2v" / "image_encoder", *shards]
        want = "ConfigError: --image-encoder: the first-frame form (TI2V) reads no CLIP image embedding"
    elif case == "prompts-for-i2v":
        (tmp_path / "p.txt").write_text("a cat\n")
        argv = ["--prompts-only", "--pipeline", made / "i2v", "--prompts", tmp_path / "p.txt", "--out", out]
        want = f"ConfigError: --prompts {tmp_path / 'p.txt'}: the model reads an image with each prompt"
    else:
        images = tmp_path / "eval.jsonl"
        images.write_text("".join(json.dumps({"path": p, "caption": "a cat"}) + "\n" for p in ("p.png", "q.png",
                                                                                                 "nope.png")))
        argv = ["--prompts-only", "--pipeline", made / "i2v", "--images", images, "--media", made / "media",
                "--out", out, *SIZE]
        want = f"DataError: --images {images} line 3: image 'nope.png' does not exist"
    rc, _, err = _run(argv)
    assert rc == 1 and len(err) == 1 and err[0].startswith(want), err
    if case == "folder-contradicts":
        assert "expand_timesteps true (the first-frame form)" in err[0] and "contradicts itself" in err[0]
    assert not out.exists()
