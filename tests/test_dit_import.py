"""SiT / DiT checkpoints into the DiT family (`models/dit/checkpoints.py`, `pretrained.import_dit / load_model`,
`launch/convert_checkpoint.py`), against independent references built in the test:

- a tiny random diffusers `DiTTransformer2DModel` (saved with save_pretrained): our network equals the diffusers
  model's own forward (its epsilon channels), fp32, at TP=1 and TP=2 (forward and the gradient of a loss);
- a tiny random official-layout state dict (the official key names and shapes, learned sigma, written here): our
  network equals a float64 re-derivation of the official forward written in this file;
- exports back to both layouts are exact, and diffusers loads its export;
- bad checkpoints and flags are one-line errors.
"""
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.models import DataShape, build_model, get_size
from dmd2_mega.pretrained import export_diffusers, export_official, import_diffusers, import_dit, load_model
from launch.convert_checkpoint import main as convert_main
from launch.convert_checkpoint import parse_args as convert_args
from tests.utils import MP_SCRIPTS, REPO, python, torchrun

INTEGRATION_FIXTURES = ("converted",)  # fixtures that launch processes: their tests are marked integration

CONVERT = os.path.join(REPO, "launch", "convert_checkpoint.py")
HIDDEN, HEADS, LAYERS, PATCH, SIZE, CLASSES = 32, 4, 2, 2, 8, 10


# ------------------------------------------------------------------------------------------ the official layout
def _pos_table(dim: int, grid: int) -> np.ndarray:
    """The official get_2d_sincos_pos_embed, re-derived: half the channels the column coordinate, half the row,
    each [sin, cos] with omega_i = 10000^(-i / (dim / 4))."""
    def one(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    rows, cols = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64), indexing="ij")
    return np.concatenate([one(dim // 2, cols), one(dim // 2, rows)], axis=1)


def official_state(channels: int = 1, learn_sigma: bool = True, seed: int = 0) -> dict:
    """A random state dict with the official SiT / DiT key names and shapes (fp32, std 0.1: adaLN-Zero's zeros
    would hide the blocks)."""
    g = torch.Generator().manual_seed(seed)
    d, out = HIDDEN, channels * (2 if learn_sigma else 1)
    shapes = {"x_embedder.proj.weight": (d, channels, PATCH, PATCH), "x_embedder.proj.bias": (d,),
              "t_embedder.mlp.0.weight": (d, 256), "t_embedder.mlp.0.bias": (d,),
              "t_embedder.mlp.2.weight": (d, d), "t_embedder.mlp.2.bias": (d,),
              "y_embedder.embedding_table.weight": (CLASSES + 1, d),
              "final_layer.linear.weight": (PATCH * PATCH * out, d), "final_layer.linear.bias": (PATCH * PATCH * out,),
              "final_layer.adaLN_modulation.1.weight": (2 * d, d), "final_layer.adaLN_modulation.1.bias": (2 * d,)}
    for i in range(LAYERS):
        b = f"blocks.{i}."
        shapes.update({b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
                       b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                       b + "mlp.fc1.weight": (4 * d, d), b + "mlp.fc1.bias": (4 * d,),
                       b + "mlp.fc2.weight": (d, 4 * d), b + "mlp.fc2.bias": (d,),
                       b + "adaLN_modulation.1.weight": (6 * d, d), b + "adaLN_modulation.1.bias": (6 * d,)})
    state = {k: 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}
    state["pos_embed"] = torch.from_numpy(_pos_table(d, SIZE // PATCH)).float()[None]
    return state


def official_forward(state: dict, x, t, y, channels: int) -> torch.Tensor:
    """The official DiT / SiT forward in float64 (models.py's maths, written out here): the network's output's
    first `channels` channels (learned sigma dropped)."""
    w = {k: v.double() for k, v in state.items()}
    x, t = x.double(), t.double()
    b, d, heads = x.shape[0], HIDDEN, HEADS
    h = F.conv2d(x, w["x_embedder.proj.weight"], w["x_embedder.proj.bias"], stride=PATCH).flatten(2).transpose(1, 2)
    h = h + w["pos_embed"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    tf = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=1)
    temb = F.linear(F.silu(F.linear(tf, w["t_embedder.mlp.0.weight"], w["t_embedder.mlp.0.bias"])),
                    w["t_embedder.mlp.2.weight"], w["t_embedder.mlp.2.bias"])
    c = F.silu(temb + w["y_embedder.embedding_table.weight"][y])

    def mod(v, shift, scale):
        return F.layer_norm(v, (d,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

    for i in range(LAYERS):
        p = f"blocks.{i}."
        s1, c1, g1, s2, c2, g2 = F.linear(c, w[p + "adaLN_modulation.1.weight"],
                                          w[p + "adaLN_modulation.1.bias"]).chunk(6, dim=1)
        qkv = F.linear(mod(h, s1, c1), w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
        q, k, v = qkv.reshape(b, -1, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1) @ v
        h = h + g1[:, None] * F.linear(att.transpose(1, 2).reshape(b, -1, d), w[p + "attn.proj.weight"],
                                       w[p + "attn.proj.bias"])
        m = F.gelu(F.linear(mod(h, s2, c2), w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]), approximate="tanh")
        h = h + g2[:, None] * F.linear(m, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
    shift, scale = F.linear(c, w["final_layer.adaLN_modulation.1.weight"],
                            w["final_layer.adaLN_modulation.1.bias"]).chunk(2, dim=1)
    out = F.linear(mod(h, shift, scale), w["final_layer.linear.weight"], w["final_layer.linear.bias"])
    g = SIZE // PATCH
    out = out.reshape(b, g, g, PATCH, PATCH, -1)
    out = torch.einsum("nhwpqc->nchpwq", out).reshape(b, -1, SIZE, SIZE)
    return out[:, :channels]


# ---------------------------------------------------------------------------------------------- diffusers layout
def diffusers_dit(channels: int = 4, seed: int = 0):
    """A tiny random DiTTransformer2DModel (learned sigma) with its per-block embedders tied, as diffusers' own
    conversion of the official DiT writes them."""
    from diffusers import DiTTransformer2DModel
    torch.manual_seed(seed)
    m = DiTTransformer2DModel(num_attention_heads=HEADS, attention_head_dim=HIDDEN // HEADS, in_channels=channels,
                              out_channels=2 * channels, num_layers=LAYERS, sample_size=SIZE, patch_size=PATCH,
                              num_embeds_ada_norm=CLASSES).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for blk in m.transformer_blocks[1:]:
            blk.norm1.emb.load_state_dict(m.transformer_blocks[0].norm1.emb.state_dict())
    return m


def _inputs(channels: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(3, channels, SIZE, SIZE, generator=g), "timestep": torch.tensor([0.0, 417.5, 999.0]),
            "labels": torch.tensor([0, 7, CLASSES]), "target": torch.randn(3, channels, SIZE, SIZE, generator=g)}


def _grads(model, inp: dict) -> dict:
    model.zero_grad()
    ((model.network(inp["x"], inp["timestep"], inp["labels"]) - inp["target"]) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both layouts, converted at TP=2 by the CLI, with the TP=2 network runs of both in one torchrun."""
    d = tmp_path_factory.mktemp("dit_import")
    official = official_state()
    torch.save({"model": {}, "ema": official}, d / "sit.pt")  # a training checkpoint: the EMA weights are read
    dm = diffusers_dit()
    dm.save_pretrained(d / "dit_diffusers")
    said = []  # in process (the CLI's flags are test_bad_checkpoints_and_flags_are_one_line_errors')
    import_dit(str(d / "sit.pt"), str(d / "sit_tp2"), 2, "sit", HEADS, log=said.append)
    assert "1 x 8^2 latents, 10 classes" in said[0], said
    import_diffusers(str(d / "dit_diffusers"), str(d / "dit_tp2"), 2, log=said.append)
    inputs = {"sit": _inputs(1), "dit": _inputs(4)}
    cases = []
    for name in inputs:
        torch.save(inputs[name], d / f"{name}_in.pt")
        cases += ["--case", str(d / f"{name}_tp2"), str(d / f"{name}_in.pt"), str(d / f"{name}_out.pt")]
    r = torchrun(2, os.path.join(MP_SCRIPTS, "dit_network_tp.py"), cases)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"dir": d, "official": official, "diffusers": dm, "inputs": inputs,
            "tp2": {n: torch.load(d / f"{n}_out.pt") for n in inputs}}


def test_official_layout_equals_float64_reference_tp1_tp2(converted):
    d, inp = converted["dir"], converted["inputs"]["sit"]
    ref = official_forward(converted["official"], inp["x"], inp["timestep"], inp["labels"], channels=1)
    model = load_model(str(d / "sit.pt"), parameterization="sit", num_heads=HEADS)
    assert model.spec.parameterization == "sit" and model.spec.num_classes == CLASSES
    with torch.no_grad():
        ours = model.network(inp["x"], inp["timestep"], inp["labels"])
    scale = ref.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(converted["tp2"]["sit"]["out"].double(), ref, rtol=0, atol=1e-5 * scale)
    grads = _grads(model.train(), inp)
    for n, g in grads.items():  # TP=2 backward equals TP=1's
        assert g.abs().max() > 0, n
        torch.testing.assert_close(converted["tp2"]["sit"]["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_diffusers_layout_equals_diffusers_forward_tp1_tp2(converted):
    d, inp, dm = converted["dir"], converted["inputs"]["dit"], converted["diffusers"]
    with torch.no_grad():
        ref = dm(inp["x"], timestep=inp["timestep"], class_labels=inp["labels"]).sample[:, :4]
    model = load_model(str(d / "dit_diffusers"))
    assert model.spec.parameterization == "vp-eps" and model.spec.freq_shift == 1
    with torch.no_grad():
        ours = model.network(inp["x"], inp["timestep"], inp["labels"])
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(converted["tp2"]["dit"]["out"], ref, rtol=0, atol=1e-5 * scale)
    grads = _grads(model.train(), inp)
    for n, g in grads.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(converted["tp2"]["dit"]["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_converted_checkpoint_builds_by_model_size_and_checks_the_data(converted):
    ckpt = str(converted["dir"] / "sit_tp2")
    model = load_model(ckpt)  # our TP=2 checkpoint joined to TP=1: the same network as the .pt
    inp = converted["inputs"]["sit"]
    with torch.no_grad():
        a = model.network(inp["x"], inp["timestep"], inp["labels"])
        b = load_model(str(converted["dir"] / "sit.pt"), parameterization="sit", num_heads=HEADS).network(
            inp["x"], inp["timestep"], inp["labels"])
    assert torch.equal(a, b)
    with pytest.raises(ConfigError, match=r"trained on 1 x 8 x 8 latents with 10 classes; the data gives 4"):
        build_model(ckpt, DataShape(4, 8, num_classes=10))
    with pytest.raises(ConfigError, match="10 classes; the data gives .* with 7 classes"):
        build_model(ckpt, DataShape(1, 8, num_classes=7))


@pytest.mark.integration
def test_exports_round_trip_to_the_layout_they_came_from(converted, tmp_path):
    d = converted["dir"]
    r = python(CONVERT, ["--load", str(d / "sit_tp2"), "--to-official", str(tmp_path / "sit.pt")])
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "sit.pt")
    src = converted["official"]
    for k, v in src.items():
        if k.startswith("final_layer.linear."):  # learned-sigma channels dropped: the first channel of (p, q, c)
            v = v.reshape(PATCH, PATCH, 2, *v.shape[1:])[:, :, :1].reshape(-1, *v.shape[1:])
        torch.testing.assert_close(back[k], v, rtol=0, atol=1e-7, msg=k)
    assert set(back) == set(src)
    # diffusers: from_pretrained loads the export and predicts what the original predicts (its eps channels)
    from diffusers import DiTTransformer2DModel
    export_diffusers(str(d / "dit_tp2"), str(tmp_path / "dit_export"), log=lambda *_: None)
    again = DiTTransformer2DModel.from_pretrained(str(tmp_path / "dit_export" / "transformer")).eval()
    inp = converted["inputs"]["dit"]
    with torch.no_grad():
        want = converted["diffusers"](inp["x"], timestep=inp["timestep"], class_labels=inp["labels"]).sample[:, :4]
        got = again(inp["x"], timestep=inp["timestep"], class_labels=inp["labels"]).sample
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="imported from the official layout; it exports with --to-official"):
        export_diffusers(str(d / "sit_tp2"), str(tmp_path / "nope"), log=lambda *_: None)
    with pytest.raises(ConfigError, match="imported from the diffusers layout; it exports with --to-diffusers"):
        export_official(str(d / "dit_tp2"), str(tmp_path / "nope.pt"), log=lambda *_: None)


@pytest.mark.integration
def test_bad_checkpoints_and_flags_are_one_line_errors(tmp_path):
    state = official_state()
    torch.save(state, tmp_path / "ok.pt")
    r = python(CONVERT, ["--from-official", str(tmp_path / "ok.pt"), "--save", str(tmp_path / "x")])
    assert r.returncode == 1 and "--parameterization sit" in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="no such file"):
        convert_main(convert_args(["--from-official", str(tmp_path / "missing.pt"), "--parameterization", "sit",
                                   "--save", str(tmp_path / "x")]))
    assert not os.path.exists(tmp_path / "x")
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 3 must divide the 4 attention heads"):
        convert_main(convert_args(["--from-official", str(tmp_path / "ok.pt"), "--parameterization", "sit",
                                   "--save", str(tmp_path / "x"), "--tensor-model-parallel-size", "3",
                                   "--num-heads", "4"]))
    with pytest.raises(ConfigError, match="--load needs one of --to-diffusers DIR / --to-official FILE"):
        convert_main(convert_args(["--load", str(tmp_path / "x")]))
    odd = {**state, "x_embedder.proj.weight": torch.zeros(48, 1, 2, 2)}
    torch.save(odd, tmp_path / "odd.pt")
    with pytest.raises(ConfigError, match="hidden size 48 is none of the published .* give --num-heads"):
        import_dit(str(tmp_path / "odd.pt"), str(tmp_path / "y"), parameterization="sit", log=lambda *_: None)
    wrong_pos = {**state, "pos_embed": state["pos_embed"] + 0.01}
    torch.save(wrong_pos, tmp_path / "pos.pt")
    with pytest.raises(CheckpointError, match="pos_embed is not the fixed sin-cos table"):
        load_model(str(tmp_path / "pos.pt"), parameterization="sit", num_heads=HEADS)
    bad = {**state, "blocks.1.mlp.fc2.weight": torch.zeros(HIDDEN, 3)}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=r"blocks.1.fc2.inner.weight has shape \[32, 3\]"):
        load_model(str(tmp_path / "bad.pt"), parameterization="vp-eps", num_heads=HEADS)
    extra = {**state, "blocks.0.attn.rope": torch.zeros(3)}
    torch.save(extra, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match="'blocks.0.attn.rope' has no place"):
        load_model(str(tmp_path / "extra.pt"), parameterization="sit", num_heads=HEADS)
    untied = diffusers_dit()
    with torch.no_grad():
        untied.transformer_blocks[1].norm1.emb.class_embedder.embedding_table.weight.add_(1.0)
    untied.save_pretrained(tmp_path / "untied")
    with pytest.raises(CheckpointError, match="differs from block 0's copy"):
        load_model(str(tmp_path / "untied"))
    with pytest.raises(ConfigError, match="is converted first: launch/convert_checkpoint.py --from-official"):
        get_size(str(tmp_path / "ok.pt"))  # --model-size FILE.pt


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
