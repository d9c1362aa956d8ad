"""The Wan family against diffusers' `WanTransformer3DModel` (the oracle), on tiny random models built here.

Each config is a random diffusers model (every parameter perturbed so that no branch is zero), saved with
`save_pretrained` and converted by `launch/convert_checkpoint.py` / `pretrained.import_diffusers`:
  * forward at TP=1 (in process) and TP=2 (torchrun, gloo): max |ours - diffusers| <= 1e-5 max |v| in fp32;
    bf16 within 3e-2;
  * backward: every parameter's gradient of mean((v - target)^2) equals diffusers' (mapped by name) to 1e-5
    of its largest entry, TP=1 and TP=2 (gradients all-gathered along their partition dims);
  * round trip diffusers -> ours (TP=2) -> diffusers is bit-exact tensor by tensor, and the exported folder
    loads with `WanTransformer3DModel.from_pretrained` and gives the original's output.
Configs: 1 and 2 layers, 2 and 3 heads, odd frame counts, H != W, text lengths 1 and 7, no cross-attention
norm, and a Wan 2.2-style 48-channel model.
"""
import json
import os
import warnings

from diffusers import WanTransformer3DModel
import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import DataShape, build_model
from dmd2_mega.models.wan import DIFFUSERS_CLASS, Wan, WanSpec
from dmd2_mega.models.wan.diffusers import diffusers_name
from dmd2_mega.pretrained import export_diffusers, import_diffusers, load_model
from tests.utils import MP_SCRIPTS, torchrun, world_of_one

pytestmark = pytest.mark.timeout(300)
FB = os.path.join(MP_SCRIPTS, "wan_forward_backward.py")

BASE = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=64)
CONFIGS = {  # name: (config overrides, latent [C, T, H, W], text length)
    "L1-H2-T3-4x6-txt1": ({}, (4, 3, 4, 6), 1),
    "L2-H3-T5-6x10-txt7": (dict(num_attention_heads=3, num_layers=2, ffn_dim=40), (4, 5, 6, 10), 7),
    "L1-H2-T1-nocrossnorm": (dict(cross_attn_norm=False, attention_head_dim=18, patch_size=(1, 1, 2)), (4, 1, 3, 4), 7),
    "wan22-48ch": (dict(in_channels=48, out_channels=48, attention_head_dim=6), (48, 2, 4, 4), 3),
}


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def make_folder(root, name: str):
    """A random diffusers model saved under root/name (deterministic per name)."""
    over, shape, text = CONFIGS[name]
    torch.manual_seed(sum(map(ord, name)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = WanTransformer3DModel(**{**BASE, **over}).eval()
    with torch.no_grad():
        for p in ref.parameters():  # nothing zero-initialised stays zero
            p.add_(0.1 * torch.randn_like(p))
    folder = os.path.join(root, name)
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, folder, shape, text


def inputs(shape, text, dim, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *shape, generator=g)
    return {"x": x, "sigma": torch.tensor([0.05, 0.9, 0.5][:b]), "cond": torch.randn(b, text, dim, generator=g),
            "target": torch.randn(b, *shape, generator=g)}


def reference(ref, inp):
    """diffusers' output, loss and {our name: grad} (our names of the same spec's model, `diffusers_name`)."""
    ref.zero_grad()
    out = ref(inp["x"], inp["sigma"] * 1000, inp["cond"]).sample
    loss = ((out - inp["target"]) ** 2).mean()
    loss.backward()
    ours = our_names(ref)
    grads = {ours[n]: p.grad.clone() for n, p in ref.named_parameters()}
    grads["patch_embedding.weight"] = grads["patch_embedding.weight"].flatten(1)
    return out.detach(), loss.detach(), grads


def our_names(ref) -> dict:
    """{diffusers name: our name} of `ref`'s config: our model of it, built on the meta device."""
    spec = WanSpec.from_config({**ref.config, "_class_name": DIFFUSERS_CLASS}, "ref")
    with torch.device("meta"):
        model = Wan(spec, DataShape(spec.in_channels, spec.patch_size, cond_shape=(1, spec.text_dim)))
    return {diffusers_name(n): n for n, _ in model.named_parameters()}


def rel(a, b, floor: float = 1e-30):
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), floor)


def grad_floor(grads: dict) -> float:
    """1% of the largest gradient entry: the scale below which a gradient is round-off (with one text token the
    cross-attention's softmax is constant, so its q / k gradients are exactly zero up to round-off)."""
    return 1e-2 * max(float(g.abs().max()) for g in grads.values())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_backward_tp1_matches_diffusers(world, tmp_path, name):
    ref, folder, shape, text = make_folder(tmp_path, name)
    inp = inputs(shape, text, BASE["text_dim"])
    want_out, want_loss, want_grads = reference(ref, inp)
    model = load_model(folder).train()
    out = model(inp["x"], inp["sigma"], inp["cond"])
    assert rel(out.detach(), want_out) <= 1e-5
    ((out - inp["target"]) ** 2).mean().backward()
    grads = dict(model.named_parameters())
    assert set(grads) == set(want_grads)
    for n, g in want_grads.items():
        assert rel(grads[n].grad, g, grad_floor(want_grads)) <= 1e-5, n


def test_bf16_forward_within_tolerance(world, tmp_path):
    ref, folder, shape, text = make_folder(tmp_path, "L2-H3-T5-6x10-txt7")
    inp = inputs(shape, text, BASE["text_dim"])
    with torch.no_grad():
        want = ref(inp["x"], inp["sigma"] * 1000, inp["cond"]).sample
        got = load_model(folder).to(torch.bfloat16)(inp["x"], inp["sigma"], inp["cond"]).float()
    assert rel(got, want) <= 3e-2


@pytest.mark.integration
@pytest.mark.parametrize("name", ["L2-H3-T5-6x10-txt7", "L1-H2-T3-4x6-txt1"])
def test_tp2_matches_diffusers_and_round_trip_is_bit_exact(world, tmp_path, name):
    if name.startswith("L2-H3"):  # 3 heads do not split over 2 ranks: an error naming the flag, nothing written
        ref, folder, shape, text = make_folder(tmp_path, name)
        with pytest.raises(ConfigError, match="--tensor-model-parallel-size 2 must divide the 3 attention heads"):
            import_diffusers(folder, str(tmp_path / "bad"), 2, log=lambda *_: None)
        assert not os.path.exists(tmp_path / "bad")
        return
    ref, folder, shape, text = make_folder(tmp_path, name)
    ckpt, out_dir = tmp_path / "ckpt_tp2", tmp_path / "export"
    import_diffusers(folder, str(ckpt), 2, log=lambda *_: None)  # the CLI runs this (test_wan_dmd2, test_wan_errors)
    assert sorted(os.listdir(ckpt / "iter_0000000")) == ["mp_rank_00", "mp_rank_01"]
    inp = inputs(shape, text, BASE["text_dim"], b=3)
    torch.save(inp, tmp_path / "inputs.pt")
    torchrun(2, FB, ["--ckpt", ckpt, "--inputs", tmp_path / "inputs.pt", "--out", tmp_path / "tp2.pt"]).check("tp2")
    got = torch.load(tmp_path / "tp2.pt")
    want_out, want_loss, want_grads = reference(ref, inp)
    assert rel(got["out"], want_out) <= 1e-5
    for n, g in want_grads.items():
        assert rel(got["grads"][n], g, grad_floor(want_grads)) <= 1e-5, n
    back = exported_bit_exact(str(ckpt), folder, out_dir)  # ours (TP=2) -> diffusers
    with torch.no_grad():
        assert torch.equal(back(inp["x"], inp["sigma"] * 1000, inp["cond"]).sample, want_out)
    cfg = json.load(open(out_dir / "scheduler" / "scheduler_config.json"))
    assert cfg["_class_name"] == "FlowMatchEulerDiscreteScheduler"


def exported_bit_exact(ckpt: str, folder: str, out_dir):
    """Export our checkpoint `ckpt` to `out_dir`; its transformer's tensors equal the diffusers `folder`'s bit for
    bit (names, dtypes, values). Returns the export loaded by `WanTransformer3DModel.from_pretrained`."""
    export_diffusers(ckpt, str(out_dir), log=lambda *_: None)
    from safetensors.torch import load_file
    a = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    b = load_file(os.path.join(out_dir, "transformer", "diffusion_pytorch_model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return WanTransformer3DModel.from_pretrained(out_dir, subfolder="transformer").eval()


def test_names_map_both_ways(world):
    model = build_model("wan-debug", DataShape(4, (1, 2, 2), cond_shape=(3, 16)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = WanTransformer3DModel(**{**BASE, "ffn_dim": 48, "num_layers": 2})
    theirs = set(ref.state_dict())
    ours = [n for n, _ in model.named_parameters()]
    assert {diffusers_name(n) for n in ours} == theirs
    assert len(ours) == len(theirs)  # one-to-one: reading a folder can map every diffusers name back
