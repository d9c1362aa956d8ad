"""launch/prepare_data.py --labels-from-folders: an ImageNet-style tree -> class-labelled latent shards.

A tiny random diffusers AutoencoderKL (2 blocks: spatial factor 2, latent_channels 4, scaling_factor 0.18215 as
sd-vae-ft-ema) is saved here; the tree has 3 class folders (listed by the file system in no particular order),
JPEG / PNG images of several sizes and aspect ratios (grey, RGBA, one in a nested folder), a corrupt JPEG, and
files that are not images of a class. At --height 16 the latents are [4, 8, 8].
Checks:
  * the pixels of every image equal ADM's / DiT's center_crop_arr done here step by step with Pillow, with the
    halvings, bicubic size and crop box worked out by hand for each image size;
  * each stored latent == AutoencoderKL.encode(x).latent_dist.mean * 0.18215 of those pixels, each label ==
    the index of the image's folder among the sorted class folders (ImageFolder's order); classes.json, index.json
    (cond "labels", num_classes 3), report.json (the corrupt file listed) and build_dataset + get_batch;
  * a resume (with --workers 0 after a --workers 2 run) keeps the finished shards and rewrites the same bytes;
  * bad flags and trees exit 1 with one line, before any model loads or anything is written.
"""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from dmd2_mega.data import build_dataset
from dmd2_mega.prep import media
from launch import prepare_data

pytestmark = pytest.mark.timeout(120)

SCALING = 0.18215
CLASSES = ["n01440764", "n01443537", "n01484850"]
# path -> (width, height, mode, ADM's steps at size 16: halvings, the bicubic size (w, h), the crop box)
IMAGES = {
    "n01440764/a.JPEG": (70, 40, "RGB", 1, (28, 16), (6, 0, 22, 16)),      # 70x40 -> 35x20 -> 28x16
    "n01440764/b.png": (20, 50, "L", 0, (16, 40), (0, 12, 16, 28)),        # grey; 20 < 32: no halving
    "n01443537/c.jpg": (12, 10, "RGB", 0, (19, 16), (1, 0, 17, 16)),       # smaller than 16: upscaled
    "n01443537/sub/d.PNG": (64, 64, "RGBA", 2, (16, 16), (0, 0, 16, 16)),  # 64 -> 32 -> 16; alpha dropped
    "n01484850/e.jpeg": (33, 47, "RGB", 1, (16, 23), (0, 3, 16, 19)),      # 33 >= 32: halved to 16x23
}
BROKEN = "n01484850/broken.JPEG"
ORDER = ["n01440764/a.JPEG", "n01440764/b.png", "n01443537/c.jpg", "n01443537/sub/d.PNG", BROKEN,
         "n01484850/e.jpeg"]  # ImageFolder's: class by class, folders then names sorted


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    from diffusers import AutoencoderKL
    d = tmp_path_factory.mktemp("imagenet")
    torch.manual_seed(0)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                  scaling_factor=SCALING).save_pretrained(d / "vae")
    rng = np.random.default_rng(0)
    for rel, (w, h, mode, *_) in IMAGES.items():
        (d / "train" / rel).parent.mkdir(parents=True, exist_ok=True)
        channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
        pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode).save(d / "train" / rel)
    (d / "train" / BROKEN).write_bytes(b"\xff\xd8\xff" + os.urandom(500))  # a JPEG header, then noise
    (d / "train" / "n01443537" / "notes.txt").write_text("not an image")
    (d / "train" / "README").write_text("not a class")
    return d


def _args(d, out, *extra):
    return ["--labels-from-folders", "--vae", str(d / "vae"), "--media", str(d / "train"), "--out", str(out),
            "--height", "16", "--shard-size", "2", "--dtype", "fp32", *extra]


@pytest.fixture(scope="module")
def run(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("in16") / "shards"
    assert prepare_data.run(_args(tree, out, "--workers", "2", "--batch-size", "2", "--num-classes", "3")) == 0
    return out


def _adm_reference(path, halvings, size, box):
    """center_crop_arr with the steps given: BOX halvings, a BICUBIC resize, the crop box (left, top, right, bottom)."""
    im = Image.open(path).convert("RGB")
    for _ in range(halvings):
        im = im.resize((im.width // 2, im.height // 2), resample=Image.Resampling.BOX)
    return np.asarray(im.resize(size, resample=Image.Resampling.BICUBIC).crop(box))


def _rows(out):
    """{path: (latent, label)} over every shard."""
    rows = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("shard_"):
            with safe_open(str(out / name), framework="pt") as f:
                lat, lab = f.get_tensor("latents"), f.get_tensor("labels")
                assert "cond" not in f.keys() and lab.dtype == torch.int64
                for i, p in enumerate(json.loads(f.metadata()["written"])):
                    rows[p] = (lat[i], int(lab[i]))
    return rows


def test_crop_is_adm_center_crop_arr(tree):
    for rel, (*_, halvings, size, box) in IMAGES.items():
        want = _adm_reference(tree / "train" / rel, halvings, size, box)
        got, reason = media.load_clip(str(tree / "train" / rel), 1, 16, 16, crop="adm")
        assert reason == "" and got.dtype == torch.uint8 and got.shape == (1, 16, 16, 3), rel
        assert np.array_equal(got[0].numpy(), want), rel
    got, reason = media.load_clip(str(tree / "train" / BROKEN), 1, 16, 16, crop="adm")
    assert got is None and reason.startswith("unreadable ("), reason
    with pytest.raises(ValueError, match="1 square frame"):
        media.load_clip(str(tree / "train" / "n01440764/a.JPEG"), 1, 16, 24, crop="adm")


def test_shards_hold_vae_means_and_folder_labels(tree, run):
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(tree / "vae").eval()
    assert vae.config.scaling_factor == SCALING
    rows = _rows(run)
    assert sorted(rows) == sorted(IMAGES)
    for rel, (*_, halvings, size, box) in IMAGES.items():
        x = torch.from_numpy(_adm_reference(tree / "train" / rel, halvings, size, box).copy())
        x = x.permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            want = vae.encode(x).latent_dist.mean[0] * SCALING
        torch.testing.assert_close(rows[rel][0], want, atol=1e-5, rtol=1e-5)
        assert rows[rel][1] == CLASSES.index(rel.split("/")[0]), rel
    assert json.loads((run / "classes.json").read_text()) == CLASSES
    index = json.loads((run / "index.json").read_text())
    shards = [{"file": f"shard_0000{k}.safetensors", "num_samples": n} for k, n in enumerate((2, 2, 1))]
    assert index == {"shards": shards, "latent_shape": [4, 8, 8], "cond": "labels", "num_classes": 3}
    assert not (run / "negative.safetensors").exists()
    report = json.loads((run / "report.json").read_text())
    assert [(s["path"], s["shard"]) for s in report["skipped"]] == [(BROKEN, "shard_00002.safetensors")]
    assert report["skipped"][0]["reason"].startswith("unreadable")
    assert (report["clips_total"], report["clips_written"]) == (6, 5)
    assert report["settings"]["crop"] == "adm" and report["settings"]["num_classes"] == 3
    with safe_open(str(run / "shard_00001.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["clips"])["paths"] == ORDER[2:4]  # ImageFolder's order, shard by shard

    ds = build_dataset(str(run))
    assert (len(ds), ds.num_classes, ds.channels, ds.spatial, ds.cond_shape) == (5, 3, 4, (8, 8), None)
    x, y = ds.get_batch(torch.tensor([4, 0, 3]))
    written = [p for p in ORDER if p != BROKEN]
    assert y.tolist() == [rows[written[i]][1] for i in (4, 0, 3)] == [2, 0, 1]
    torch.testing.assert_close(x, torch.stack([rows[written[i]][0] for i in (4, 0, 3)]))


def test_resume_keeps_finished_shards(tree, run, tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    for name in ("shard_00000.safetensors", "shard_00002.safetensors"):
        (out / name).write_bytes((run / name).read_bytes())
    before = {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)}
    assert prepare_data.run(_args(tree, out, "--workers", "0", "--batch-size", "2")) == 0
    printed = capsys.readouterr().out
    assert "6 images in 3 class folders (2 other files left out)" in printed and "2 already written" in printed
    assert {n: (out / n).stat().st_mtime_ns for n in before} == before
    assert json.loads((out / "report.json").read_text())["shards_resumed"] == [0, 2]
    for name in ("index.json", "classes.json"):
        assert (out / name).read_bytes() == (run / name).read_bytes(), name
    f, g = (safe_open(str(d / "shard_00001.safetensors"), framework="pt") for d in (out, run))  # rewritten
    assert f.metadata() == g.metadata() and sorted(f.keys()) == sorted(g.keys()) == ["labels", "latents"]
    assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in f.keys())
    # another size into the same --out is refused, naming the shard
    assert prepare_data.run(_args(tree, out, "--width", "8", "--height", "8")) == 1
    assert "shard_00000.safetensors was written with other settings" in capsys.readouterr().err


def _tree_without_classes(d):
    (d / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(d / "flat" / "x.png")
    return ["--media", str(d / "flat")]


def _tree_with_empty_class(d):
    for name in ("cat", "dog"):
        (d / "t" / name).mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(d / "t" / "cat" / "x.png")
    (d / "t" / "dog" / "readme.txt").write_text("no image")
    return ["--media", str(d / "t")]


def _wan_vae(d):
    (d / "wan").mkdir()
    (d / "wan" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 4,
                                                       "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}))
    return ["--vae", str(d / "wan")]


@pytest.mark.parametrize("extra, line", [
    (["--captions", "c.csv"], "ConfigError: --captions with --labels-from-folders"),
    (["--text-encoder", "te"], "ConfigError: --text-encoder with --labels-from-folders"),
    (["--negative-prompt", "blurry"], "ConfigError: --negative-prompt with --labels-from-folders"),
    (["--prompts-only"], "ConfigError: --prompts-only encodes text"),
    (["--width", "24"], "ConfigError: --height 16 --width 24: --labels-from-folders makes square crops"),
    (["--height", "15"], "ConfigError: --height 15: the VAE"),
    (["--num-classes", "1000"], "DataError: --num-classes 1000: --media "),
    (_tree_without_classes, "DataError: --media "),
    (_tree_with_empty_class, "DataError: --media "),
    (_wan_vae, "ConfigError: --vae "),
], ids=["captions", "text-encoder", "negative-prompt", "prompts-only", "not-square", "odd-size", "num-classes",
        "no-class-folders", "empty-class", "video-vae"])
def test_bad_flags_and_trees_fail_in_one_line(tree, tmp_path, capsys, monkeypatch, extra, line):
    from dmd2_mega.prep import run as prep_run

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")
    monkeypatch.setattr(prep_run.LatentVAE, "from_folder", loaded)
    monkeypatch.setattr(prep_run.TextEncoder, "from_folder", loaded)
    out = tmp_path / "out"
    assert prepare_data.run(_args(tree, out, *(extra(tmp_path) if callable(extra) else extra))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
    ends = {_tree_without_classes: "no class subfolders", _tree_with_empty_class: "class folder dog/ holds no image",
            _wan_vae: "AutoencoderKLWan is a video VAE"}
    if callable(extra):
        assert ends[extra] in err[0], err
    if "--num-classes" in line:
        assert "has 3 class folders (n01440764 ... n01484850)" in err[0]
    assert not out.exists()
