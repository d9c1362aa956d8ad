"""launch/sample.py --image --prompt --pipeline (issue 50): an error names the flags the user gave, and a run that
fails leaves nothing in --out.

The condition is made by prepare_data's --prompts-only --images from a one-row file sample.py writes for it; that
file once lay in <out>/conditions.csv and prepare_data's errors named it (`--images O/conditions.csv line 2: image
... unreadable`), a flag and a file the user never gave, and it stayed in --out. Now the image is read before
anything is loaded, prepare_data's messages are put in the flags given, the one-row file lives in a temporary folder,
and what the run wrote into --out (conditions.safetensors, the folders it made) is removed when it fails later.
In-process runs on the first-frame (TI2V) student of tests/test_wan_i2v_export.py: a tiny WanImageToVideoPipeline
folder and a student checkpoint of its transformer with I2V data.
"""
import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

from dmd2_mega.train.checkpoint import iter_dir, rank_file, save_offline
from launch import sample
from tests.test_export_atomic import LATENT
from tests.test_wan_i2v_export import FORMS, SIGMAS, TEXT, _i2v_pipeline
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{"base": the pipeline folder, "student": the checkpoint, "image": a readable first frame}."""
    from PIL import Image

    from dmd2_mega.pretrained import import_diffusers
    d = tmp_path_factory.mktemp("i2v_image")
    c, t, h, w = LATENT
    with world_of_one(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _i2v_pipeline(d / "base", "ti2v")
        import_diffusers(str(d / "base"), str(d / "teacher"), log=lambda *_: None)
        payload = torch.load(rank_file(iter_dir(str(d / "teacher"), 0), 0), weights_only=False)
    parts = [["text", list(TEXT)], ["image", [c, FORMS["ti2v"][1], h, w]]]
    info = {"in_channels": c, "latent_shape": LATENT, "num_classes": None, "cond_parts": parts,
            "cond_shape": [sum(int(np.prod(s)) for _, s in parts)]}
    payload.update(student_sigmas=SIGMAS, iteration=7, data_info=info)
    save_offline(str(d / "student"), 7, [payload])
    shutil.copy(d / "teacher" / "config.json", d / "student" / "config.json")
    pixels = np.random.default_rng(0).integers(0, 256, (8 * h, 8 * w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(d / "frame.png")
    return {"base": str(d / "base"), "student": str(d / "student"), "image": str(d / "frame.png")}


def run(made, image, out, *more, pipeline=None) -> int:
    with world_of_one():
        return sample.main(["--load", made["student"], "--image", str(image), "--prompt", "a cat", "--pipeline",
                            pipeline or made["base"], "--out", str(out), *map(str, more)])


def error(capsys) -> str:
    """The one error line, the last on stderr (transformers' progress bar may come before it)."""
    err = capsys.readouterr().err
    assert err.endswith("\n") and sum("Error: " in line for line in err.splitlines()) == 1, err
    return err.splitlines()[-1] + "\n"


@pytest.mark.parametrize("case", ["truncated", "not an image", "no image extension"])
def test_an_image_that_cannot_be_read_is_named_as_given_and_nothing_is_written(made, tmp_path, capsys, case):
    """`--image truncated.png --out O` said `--images O/conditions.csv line 2: ...` and left O/conditions.csv."""
    whole = open(made["image"], "rb").read()
    image = tmp_path / {"truncated": "frame.png", "not an image": "frame.jpg", "no image extension": "frame.txt"}[case]
    image.write_bytes(whole[:len(whole) // 2] if case == "truncated" else b"plain text\n" if case == "not an image"
                      else whole)
    out = tmp_path / "O"
    assert run(made, image, out) == 1
    expected = {"truncated": f"DataError: --image {image}: unreadable (OSError: image file is truncated",
                "not an image": f"DataError: --image {image}: unreadable (",
                "no image extension": f"ConfigError: --image {image}: not an image or a video (expected one of .png"}
    err = error(capsys)
    assert err.startswith(expected[case]), err
    assert "--images" not in err and "conditions.csv" not in err
    assert not out.exists()


def test_prepare_datas_errors_name_the_flags_given(made, tmp_path, capsys):
    """A pipeline folder without its text encoder: named as --pipeline's, not as a --text-encoder never given."""
    pipeline = tmp_path / "no_text_encoder"
    shutil.copytree(made["base"], pipeline, ignore=shutil.ignore_patterns("text_encoder"))
    out = tmp_path / "new" / "O"
    assert run(made, made["image"], out, pipeline=str(pipeline)) == 1
    err = error(capsys)
    assert err.startswith(f"ConfigError: --pipeline {pipeline}: its text encoder {pipeline}/text_encoder: not a "
                          f"directory"), err
    assert not (tmp_path / "new").exists()  # the folders the run made for --out are gone too


def test_an_image_prepare_data_cannot_read_is_named_as_given(made, tmp_path, capsys, monkeypatch):
    """An image read at the checkpoint's size that fails there (after the first read passed): --image, not the
    one-row --images file made for it."""
    from dmd2_mega.prep import image as prep_image
    monkeypatch.setattr(prep_image, "load_clip", lambda *_, **__: (None, "unreadable (OSError: broken data stream)"))
    out = tmp_path / "O"
    assert run(made, made["image"], out) == 1
    assert error(capsys) == f"DataError: --image {made['image']}: unreadable (OSError: broken data stream)\n"
    assert not out.exists()


def test_a_run_that_fails_after_the_condition_is_written_leaves_nothing(made, tmp_path, capsys):
    """--vae of another latent width is refused after the condition was made: its conditions.safetensors goes, the
    folder made for --out goes, a folder that was there stays with its files."""
    vae = tmp_path / "vae8"
    shutil.copytree(os.path.join(made["base"], "vae"), vae)
    config = json.loads((vae / "config.json").read_text())
    config.update(z_dim=8, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    (vae / "config.json").write_text(json.dumps(config))
    there = tmp_path / "there"
    there.mkdir()
    (there / "mine.txt").write_text("kept")
    for out in (tmp_path / "O", there / "O", there):
        assert run(made, made["image"], out, "--vae", vae) == 1
        assert error(capsys).startswith(f"ConfigError: --vae {vae}: the VAE's latents have 8 channels, but the "
                                        f"model's have 4")
        assert not (tmp_path / "O").exists() and not (there / "O").exists()
        assert os.listdir(there) == ["mine.txt"] and (there / "mine.txt").read_text() == "kept"
