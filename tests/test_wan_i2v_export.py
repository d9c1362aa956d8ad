"""An image-to-video student exported with --to-diffusers runs in diffusers' own WanImageToVideoPipeline (issue 32,
item 4), for the concat form with CLIP (Wan 2.1 I2V) and the first-frame form (TI2V, the pipeline's
expand_timesteps).

A tiny WanImageToVideoPipeline folder is built here (tests/utils.tiny_wan_pipeline_parts, a tiny random CLIP vision
model and its processor for Wan 2.1, an I2V WanTransformer3DModel); its transformer is converted into a teacher, and
a "student" is that checkpoint with a shifted 3-step grid and the I2V data it was trained on (text [512, 16], CLIP
[5, 8], image latent; latents [4, 3, 2, 4]: 9 frames of 16 x 32). Checked:
  * README.md's snippet runs as written (folders and the image file substituted): WanImageToVideoPipeline gives a
    video of the trained frame count and size on the student's sigmas;
  * the pipeline's final latents for the student's 3 steps (its stochastic re-noising drawn from torch's global
    RNG, replayed here) equal our sampler's last-step x0 (`sampling.few_step_sample`, then `pin_given`) on the
    condition made from the pipeline's own encode_prompt, encode_image and prepare_latents, to 1e-5 of max |x|;
    the first-frame form keeps the given image's latent as its first frame, as the pipeline returns it;
  * prepare_data.py --prompts-only --images on the pipeline folder, then launch/sample.py --prompts on the student:
    a decoded sample per (image, prompt) row, which depends on the image (the first-frame form starts with it);
    sample.py --image --prompt --pipeline makes the same condition itself.
"""
import json
import os
import warnings

import numpy as np
import pytest
import torch

from dmd2_mega.data.prompts import read_prompts
from dmd2_mega.flow import student_sigmas
from dmd2_mega.models import get_spec
from dmd2_mega.sampling import few_step_sample, load_sampling_model
from dmd2_mega.train.checkpoint import iter_dir, rank_file, save_offline
from tests.test_export_atomic import LATENT, _run_snippet, convert
from launch import prepare_data
from tests.utils import (SAMPLE, python, tiny_clip_parts, tiny_wan_pipeline_parts, tiny_wan_transformer,
                         world_of_one)

pytestmark = pytest.mark.timeout(300)
SIGMAS = student_sigmas(3, shift=3.0).tolist()
TEXT, CLIP = (512, 16), (5, 8)  # the pipeline pads the text to 512 tokens; a 28 px CLIP of 14 px patches: 5 tokens
FORMS = {  # name: (transformer config over wan-debug's, the image latent's frames, the pipeline's expand_timesteps)
    "wan21-i2v": (dict(in_channels=12, out_channels=4, image_dim=8, added_kv_proj_dim=24), LATENT[1], False),
    "ti2v": (dict(in_channels=4, out_channels=4), 1, True),
}


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def _i2v_pipeline(folder, name: str) -> None:
    from diffusers import WanImageToVideoPipeline
    config, _, expand = FORMS[name]
    clip = {} if expand else tiny_clip_parts(CLIP[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        WanImageToVideoPipeline(transformer=tiny_wan_transformer(3, ffn_dim=32, rope_max_seq_len=64, **config),
                                expand_timesteps=expand, **clip, **tiny_wan_pipeline_parts()).save_pretrained(folder)


@pytest.fixture(scope="module", params=sorted(FORMS))
def made(world, tmp_path_factory, request):
    """{"base", "student", "info", "form"} for one form: the pipeline folder and the student checkpoint."""
    from dmd2_mega.pretrained import import_diffusers
    name = request.param
    d = tmp_path_factory.mktemp(f"i2v_export_{name}")
    _i2v_pipeline(d / "base", name)
    import_diffusers(str(d / "base"), str(d / "teacher"), log=lambda *_: None)
    payload = torch.load(rank_file(iter_dir(str(d / "teacher"), 0), 0), weights_only=False)
    c, t, h, w = LATENT
    parts = [["text", list(TEXT)], *([] if FORMS[name][2] else [["clip", list(CLIP)]]),
             ["image", [c, FORMS[name][1], h, w]]]
    info = {"in_channels": c, "latent_shape": LATENT, "num_classes": None, "cond_parts": parts,
            "cond_shape": [sum(int(np.prod(s)) for _, s in parts)]}
    payload.update(student_sigmas=SIGMAS, iteration=7, data_info=info)
    save_offline(str(d / "student"), 7, [payload])
    with open(d / "teacher" / "config.json") as f, open(d / "student" / "config.json", "w") as g:
        g.write(f.read())
    return {"base": str(d / "base"), "student": str(d / "student"), "info": info, "name": name, "payload": payload}


def _first_frame(path, seed: int = 0) -> "PIL.Image.Image":
    from PIL import Image
    _, _, h, w = LATENT
    pixels = np.random.default_rng(seed).integers(0, 256, (8 * h, 8 * w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return Image.open(path).convert("RGB")


def test_pipeline_runs_the_exported_student_and_equals_our_sampler(made, tmp_path, world):
    out = tmp_path / "export"
    rc, _, err = convert(["--load", made["student"], "--to-diffusers", out])
    assert rc == 0 and err == [], err
    readme = (out / "README.md").read_text()
    image = _first_frame(tmp_path / "first.png")
    code = readme[readme.index("```python\n") + 10:readme.rindex("```")]
    for place, value in (("<this folder>", out), ("<the base Wan pipeline folder>", made["base"]),
                         ("<the first frame: an image file>", tmp_path / "first.png")):
        assert place in code, place
        code = code.replace(place, str(value))
    assert "WanImageToVideoPipeline" in code and ("expand_timesteps=True" in code) == FORMS[made["name"]][2]
    ns = _run_snippet(code)
    c, t, h, w = LATENT
    assert ns["video"].shape == ((t - 1) * 4 + 1, 8 * h, 8 * w, 3)
    pipe = ns["pipe"]
    assert pipe.scheduler.sigmas.tolist() == pytest.approx(SIGMAS + [0.0], abs=1e-6)

    # the pipeline's final latents, its noise drawn from the global RNG: the start, then one draw per step
    frames, size = (t - 1) * 4 + 1, dict(height=8 * h, width=8 * w)
    torch.manual_seed(5)
    noise = torch.randn(len(SIGMAS) + 1, 1, c, t, h, w)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pipe(image=image, prompt="a cat", guidance_scale=1.0, num_inference_steps=len(SIGMAS),
                      num_frames=frames, output_type="latent", **size).frames
        # our condition from the pipeline's own preparation of the same prompt and image
        text = pipe.encode_prompt("a cat", do_classifier_free_guidance=False, max_sequence_length=TEXT[0])[0]
        clip = [pipe.encode_image(image, "cpu")] if pipe.image_encoder is not None else []
        pixels = pipe.video_processor.preprocess(image, **size)
        prepared = pipe.prepare_latents(pixels, 1, c, num_frames=frames, dtype=torch.float32, device="cpu",
                                        latents=noise[0], **size)
    latent = prepared[1] if FORMS[made["name"]][2] else prepared[1][:, 4:]  # [mask, image latent] on channels
    cond = torch.cat([p.flatten(1) for p in (text, *clip, latent)], dim=1)
    model, _ = load_sampling_model(made["payload"], made["info"], world)
    model.eval()
    ours = model.pin_given(few_step_sample(model, noise[:len(SIGMAS)], cond, torch.tensor(SIGMAS)), cond)
    scale = float(theirs.abs().max())
    assert scale > 0.1 and float((ours - theirs).abs().max()) <= 1e-5 * scale
    if FORMS[made["name"]][2]:  # the first-frame form returns the given image's latent as its first frame
        assert torch.equal(ours[:, :, :1], latent.to(ours.dtype))


@pytest.mark.integration
def test_sample_py_on_eval_images_prepared_from_the_pipeline(made, tmp_path):
    """prepare_data.py --prompts-only --images on the pipeline folder, then launch/sample.py --prompts on the student:
    one sample per (image, prompt) row, decoded by the pipeline's VAE; another image gives another sample; the
    first-frame form's sample starts with the given image's latent."""
    c, t, h, w = LATENT
    rows = ["path,caption"]
    for i in range(2):
        _first_frame(tmp_path / f"{i}.png", seed=i)
        rows.append(f"{i}.png,a cat")
    (tmp_path / "images.csv").write_text("\n".join(rows) + "\n")
    prompts = tmp_path / "eval.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert prepare_data.run([str(a) for a in [
            "--prompts-only", "--pipeline", made["base"], "--images", tmp_path / "images.csv", "--out", prompts,
            "--frames", (t - 1) * 4 + 1, "--height", 8 * h, "--width", 8 * w, "--max-text-len", TEXT[0],
            "--dtype", "fp32"]]) == 0
    python(SAMPLE, ["--load", made["student"], "--prompts", prompts, "--out", tmp_path / "s", "--vae",
                    os.path.join(made["base"], "vae")]).check("sample.py --prompts")
    got = np.load(tmp_path / "s" / "samples.npz")
    assert got["images"].shape == (2, c, t, h, w) and list(got["prompts"]) == ["a cat"] * 2
    assert np.abs(got["images"][0] - got["images"][1]).max() > 1e-3  # the image is read
    assert len(os.listdir(tmp_path / "s" / "media")) >= 2
    # --image --prompt --pipeline: the same condition as row 0, made in sample.py
    python(SAMPLE, ["--load", made["student"], "--image", tmp_path / "0.png", "--prompt", "a cat", "--pipeline",
                    made["base"], "--out", tmp_path / "one"]).check("sample.py --image")
    one = np.load(tmp_path / "one" / "samples.npz")["images"]
    assert one.shape == (1, c, t, h, w) and os.listdir(tmp_path / "one" / "media")
    cond = read_prompts(str(prompts)).cond
    assert torch.equal(read_prompts(str(tmp_path / "one" / "conditions.safetensors")).cond, cond[:1])
    if FORMS[made["name"]][2]:  # the given frame's latent, as read back from the prompts file
        image = cond[:, -c * h * w:].reshape(2, c, 1, h, w).clamp(-1, 1).numpy()
        np.testing.assert_array_equal(got["images"][:, :, :1], image)
