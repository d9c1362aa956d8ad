"""The Wan family's image-to-video forms against diffusers' `WanTransformer3DModel` fed as WanImageToVideoPipeline
feeds it (`models/wan/image.py`), on tiny random models built here:
  * Wan 2.1 I2V (image_dim, added_kv_proj_dim, in_channels = 2 out + 4): [x, mask, image latent] on channels, the
    CLIP embedding as extra cross-attention keys / values;
  * Wan 2.2 I2V A14B's form (in_channels = 2 out + 4, no CLIP);
  * Wan 2.2 TI2V's image mode (a text-to-video config, the pipeline's expand_timesteps): the first latent frame
    replaced by the image's and per-token timesteps, 0 on the first frame's tokens.
Our model reads ONE flat condition per sample (text, CLIP, image latent). The reference builds the pipeline's mask
the pipeline's way (pixel-frame mask, first frame repeated over the VAE's 4, viewed per latent frame) and its
per-token timesteps from the mask. Checked: forward within 1e-5 of max |v| in fp32 and every parameter's gradient
within 1e-5 of the largest, at TP=1 and TP=2 (torchrun, gloo); the round trip diffusers -> ours (TP=2) -> diffusers
is bit-exact; CFG's negative keeps the image and swaps the text; malformed image data is one ConfigError.
"""
import os

import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import DataShape, build_model, get_spec
from dmd2_mega.models.wan import DIFFUSERS_CLASS, Wan, WanSpec
from dmd2_mega.models.wan.diffusers import diffusers_name
from dmd2_mega.pretrained import import_diffusers
from dmd2_mega.train.checkpoint import load_model_weights, load_payload
from tests.test_wan_diffusers import exported_bit_exact, grad_floor, rel
from tests.utils import MP_SCRIPTS, tiny_wan_transformer, torchrun, world_of_one

pytestmark = pytest.mark.timeout(300)
FB = os.path.join(MP_SCRIPTS, "wan_forward_backward.py")
TEXT = (512, 16)  # diffusers' I2V attention takes the text as the last 512 context tokens
CLIP = (257, 8)
BASE = dict(ffn_dim=32, rope_max_seq_len=64)  # over wan-debug's config (tests/utils.tiny_wan_transformer)
FORMS = {  # name: (config overrides, latent [C, T, H, W], form)
    "wan21-i2v": (dict(in_channels=12, out_channels=4, image_dim=8, added_kv_proj_dim=24), (4, 3, 4, 6), "concat"),
    "wan22-i2v": (dict(in_channels=12, out_channels=4), (4, 2, 4, 4), "concat"),
    "ti2v": (dict(in_channels=4, out_channels=4), (4, 3, 4, 6), "first-frame"),
}


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def make_folder(root, name: str):
    over, shape, form = FORMS[name]
    ref = tiny_wan_transformer(sum(map(ord, name)), **{**BASE, **over}).eval()
    folder = os.path.join(root, name)
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, folder, shape, form


def inputs(name: str, b: int = 2, seed: int = 0) -> dict:
    over, shape, form = FORMS[name]
    g = torch.Generator().manual_seed(seed)
    c, t, h, w = shape
    x, text = torch.randn(b, *shape, generator=g), torch.randn(b, *TEXT, generator=g)
    clip = torch.randn(b, *CLIP, generator=g) if "image_dim" in over else None
    image = torch.randn(b, c, t if form == "concat" else 1, h, w, generator=g)
    parts = (("text", TEXT), *((("clip", CLIP),) if clip is not None else ()), ("image", tuple(image.shape[1:])))
    cond = torch.cat([p.flatten(1) for p in (text, clip, image) if p is not None], dim=1)
    return {"x": x, "sigma": torch.tensor([0.05, 0.9, 0.5][:b]), "cond": cond, "cond_parts": parts,
            "text": text, "clip": clip, "image": image, "target": torch.randn(b, *shape, generator=g)}


def pipeline_mask(b: int, t: int, h: int, w: int) -> torch.Tensor:
    """WanImageToVideoPipeline.prepare_latents' mask, built its way: a pixel-frame mask (1 on the first of
    (t - 1) 4 + 1 frames), the first frame repeated 4 times, viewed as [b, 4, t, h, w]."""
    frames = (t - 1) * 4 + 1
    m = torch.ones(b, 1, frames, h, w)
    m[:, :, 1:] = 0
    m = torch.cat([m[:, :, :1].repeat_interleave(4, dim=2), m[:, :, 1:]], dim=2)
    return m.view(b, -1, 4, h, w).transpose(1, 2)


def diffusers_call(ref, inp: dict, form: str) -> torch.Tensor:
    x, t = inp["x"], inp["sigma"] * 1000
    b, _, f, h, w = x.shape
    if form == "concat":
        hidden = torch.cat([x, pipeline_mask(b, f, h, w), inp["image"]], dim=1)
        return ref(hidden, t, inp["text"], encoder_hidden_states_image=inp["clip"]).sample
    mask = torch.ones(1, 1, f, h, w)
    mask[:, :, 0] = 0  # the pipeline's first_frame_mask with expand_timesteps
    hidden = (1 - mask) * inp["image"] + mask * x
    per_token = mask[0][0][:, ::2, ::2].flatten()  # the pipeline's temp_ts, per sample's t
    return ref(hidden, per_token[None] * t[:, None], inp["text"]).sample


def our_names(ref, inp: dict) -> dict:
    spec = WanSpec.from_config({**ref.config, "_class_name": DIFFUSERS_CLASS}, "ref")
    with torch.device("meta"):
        model = Wan(spec, DataShape(spec.out_channels, inp["x"].shape[2:], cond_parts=inp["cond_parts"]))
    return {diffusers_name(n): n for n, _ in model.named_parameters()}


def reference(ref, inp: dict, form: str):
    ref.zero_grad()
    out = diffusers_call(ref, inp, form)
    ((out - inp["target"]) ** 2).mean().backward()
    names = our_names(ref, inp)
    grads = {names[n]: p.grad.clone() for n, p in ref.named_parameters()}
    grads["patch_embedding.weight"] = grads["patch_embedding.weight"].flatten(1)
    return out.detach(), grads


def ours(ckpt: str, inp: dict, ps):
    shape = DataShape(inp["x"].shape[1], tuple(inp["x"].shape[2:]), cond_parts=inp["cond_parts"])
    model = build_model(ckpt, shape)
    load_model_weights(model, load_payload(ckpt, ps, flag="--ckpt")["model"], ckpt)
    return model.train()


@pytest.mark.parametrize("name", list(FORMS))
def test_each_form_matches_diffusers_at_tp1(world, tmp_path, name):
    ref, folder, shape, form = make_folder(tmp_path, name)
    import_diffusers(folder, str(tmp_path / "ckpt"), 1, log=lambda *_: None)
    inp = inputs(name)
    want_out, want_grads = reference(ref, inp, form)
    model = ours(str(tmp_path / "ckpt"), inp, world)
    assert model.image_form == form
    out = model(inp["x"], inp["sigma"], inp["cond"])
    assert rel(out.detach(), want_out) <= 1e-5
    ((out - inp["target"]) ** 2).mean().backward()
    got = dict(model.named_parameters())
    assert set(got) == set(want_grads)
    for n, g in want_grads.items():
        assert rel(got[n].grad, g, grad_floor(want_grads)) <= 1e-5, n
    if form == "concat" and "clip" in dict(inp["cond_parts"]):  # the image K/V matter: another CLIP, another v
        other = dict(inp, cond=inp["cond"].clone())
        other["cond"][:, TEXT[0] * TEXT[1]:][:, :CLIP[0] * CLIP[1]] = torch.randn(2, CLIP[0] * CLIP[1])
        assert rel(model(other["x"], other["sigma"], other["cond"]).detach(), want_out) > 1e-3


@pytest.mark.integration
@pytest.mark.parametrize("name", ["wan21-i2v", "ti2v"])
def test_tp2_matches_diffusers_and_round_trip_is_bit_exact(world, tmp_path, name):
    ref, folder, shape, form = make_folder(tmp_path, name)
    ckpt, out_dir = tmp_path / "ckpt_tp2", tmp_path / "export"
    import_diffusers(folder, str(ckpt), 2, log=lambda *_: None)
    inp = inputs(name, b=3)
    torch.save(inp, tmp_path / "inputs.pt")
    torchrun(2, FB, ["--ckpt", ckpt, "--inputs", tmp_path / "inputs.pt", "--out", tmp_path / "tp2.pt"]).check("tp2")
    got = torch.load(tmp_path / "tp2.pt")
    want_out, want_grads = reference(ref, inp, form)
    assert rel(got["out"], want_out) <= 1e-5
    for n, g in want_grads.items():
        assert rel(got["grads"][n], g, grad_floor(want_grads)) <= 1e-5, n
    back = exported_bit_exact(str(ckpt), folder, out_dir)
    with torch.no_grad():
        assert torch.equal(diffusers_call(back, inp, form), diffusers_call(ref.eval(), inp, form))


def test_cfg_negative_keeps_the_image_and_swaps_the_text(world):
    spec = get_spec("wan-i2v-debug")
    inp = inputs("wan21-i2v")
    model = Wan(spec, DataShape(4, (3, 4, 6), cond_parts=inp["cond_parts"]))
    negative = torch.randn(*TEXT)
    model.set_negative(negative)
    neg = model.negative_for(inp["cond"])
    n = TEXT[0] * TEXT[1]
    assert torch.equal(neg[:, n:], inp["cond"][:, n:]) and torch.equal(neg[:, :n], negative.flatten().expand(2, n))
    with pytest.raises(ValueError, match="negative_for"):
        model.null_cond(2, "cpu")


@pytest.mark.parametrize("parts, words", [
    ((("text", TEXT), ("image", (4, 3, 4, 6))), "CLIP image embeddings are None"),
    ((("text", TEXT), ("clip", CLIP), ("image", (4, 1, 4, 6))), "image latents are [4, 1, 4, 6]"),
    ((("image", (4, 3, 4, 6)), ("text", TEXT)), "condition parts are ['image', 'text']"),
    (None, "must carry each clip's image latent"),
])
def test_image_data_the_model_cannot_read_is_one_config_error(world, parts, words):
    spec = get_spec("wan-i2v-debug")
    shape = DataShape(4, (3, 4, 6), cond_parts=parts) if parts else DataShape(4, (3, 4, 6), cond_shape=TEXT)
    with pytest.raises(ConfigError) as e:
        Wan(spec, shape)
    assert words in str(e.value) and "\n" not in str(e.value)
