"""launch/prepare_data.py and dmd2_mega/prep against diffusers / transformers called directly.

Models are tiny and random, built here and saved with save_pretrained (nothing is downloaded): an
AutoencoderKLWan (spatial 8, temporal 4, z_dim 4), an AutoencoderKL (spatial 8, shift + scaling), a 1-layer
UMT5EncoderModel (d_model 16) with a WordLevel tokenizer (</s> appended) in a pipeline-style folder.
Media: lossless GIFs with one flat colour per frame (so the sampled frames are known exactly), an mp4
(ffmpeg), PNGs, a corrupt mp4, a too-short GIF and a listed-but-missing file.
Checks:
  * video shards == diffusers AutoencoderKLWan.encode(...).latent_dist.mode() normalised as the inverse of
    WanPipeline's decode step, on frames read independently with imageio; cond / negative == WanPipeline
    .encode_prompt with the same encoder and tokenizer; text_len == the tokenizer's mask sums; the skipped
    files are in report.json and the printed summary; ShardDataset opens the output.
  * --sample-posterior: one draw per clip, the same whatever the shard and batch sizes, not the mean.
  * image shards == AutoencoderKL mode, (x - shift_factor) * scaling_factor.
  * report.json's keys (its lists' entries' too) == the fields docs/prepare_data.md's table documents.
  * LatentVAE.decode == diffusers decode of WanPipeline's un-normalised latents; a posterior draw.
  * resize + centre crop vs Pillow; frame indices at --fps.
  * bad flags / captions exit 1 with one line naming the flag, before any model loads or file is written.
  * --prompts-only == WanPipeline.encode_prompt, read back with read_prompts.
  * one 2-rank job (gloo, torchrun's environment) whose rank 1 is SIGKILLed halfway through writing its shard:
    no partial shard, the stale temp file is removed, and a 1-rank resume equals the uninterrupted run.
"""
import contextlib
import csv
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from dmd2_mega.data import ShardDataset
from dmd2_mega.data.prompts import read_prompts
from dmd2_mega.errors import ConfigError
from dmd2_mega.prep import media
from dmd2_mega.prep.text import DEFAULT_NEGATIVE
from dmd2_mega.prep.writer import build_report, read_shard_headers
from dmd2_mega.prep.vae import LatentVAE
from launch import prepare_data

pytestmark = pytest.mark.timeout(240)
INTEGRATION_FIXTURES = ("setup", "video_run",)  # they encode media with ffmpeg, a process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "prepare_data.py")
DOCS = os.path.join(ROOT, "docs", "prepare_data.md")
WORDS = ["a", "cat", "dog", "runs", "on", "the", "grass", "red", "ball", "&", "sky", "blue", "jumps", "over"]
L = 8  # --max-text-len: the long caption below is truncated
CAPTIONS = {"a.gif": "a  cat &amp;amp; dog\n runs", "b.mp4": "the red ball", "c.gif": "a dog jumps over the "
            "red ball on the grass under the blue sky", "corrupt.mp4": "sky", "missing.webm": "cat",
            "short.gif": "dog"}


def _gif(path, colours, size=(20, 16)):
    frames = [Image.fromarray(np.full((*size, 3), c, dtype=np.uint8)) for c in colours]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The tiny VAEs, tokenizer and text encoder, and the PNGs with their captions.jsonl: no process runs, so the
    tests that need no video stay in the fast tier."""
    from diffusers import AutoencoderKL, AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    d = tmp_path_factory.mktemp("prep")
    pipe = d / "pipe"
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                     latents_std=[0.5, 2.0, 1.5, 1.0]).save_pretrained(pipe / "vae")
    AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=4,
                  layers_per_block=1, scaling_factor=0.5, shift_factor=0.1).save_pretrained(d / "klvae")
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(pipe / "tokenizer")
    UMT5EncoderModel(UMT5Config(vocab_size=len(vocab), d_model=16, d_kv=4, num_heads=2, d_ff=32, num_layers=1,
                                relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                decoder_start_token_id=0)).save_pretrained(pipe / "text_encoder")
    imgs = d / "images"
    imgs.mkdir()
    rng = np.random.default_rng(0)
    for name, hw in (("p1.png", (16, 16)), ("p2.png", (16, 24)), ("p3.png", (40, 16))):
        Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)).save(imgs / name)
    (imgs / "captions.jsonl").write_text("".join(json.dumps({"path": p, "caption": c}) + "\n" for p, c in
                                                 (("p2.png", "blue sky"), ("p1.png", "a cat"), ("p3.png", "dog"))))
    return d


@pytest.fixture(scope="module")
def setup(tiny_models):
    """`tiny_models` plus the videos and their captions.csv (the mp4 is encoded by ffmpeg, a process)."""
    d = tiny_models
    vids = d / "videos"
    vids.mkdir()
    _gif(vids / "a.gif", [(10 * i, 255 - 20 * i, 7 * i) for i in range(9)])   # 9 frames, 20 x 16 (h x w)
    _gif(vids / "c.gif", [(200 - 9 * i, 5 * i, 128) for i in range(7)])
    _gif(vids / "short.gif", [(1, 2, 3), (4, 5, 6), (7, 8, 9)])                 # 3 < --frames 5
    ramp = np.linspace(0, 255, 24 * 32 * 3).reshape(24, 32, 3)
    imageio.mimwrite(vids / "b.mp4", [np.roll(ramp, 4 * i, 1).astype(np.uint8) for i in range(12)], fps=8,
                     macro_block_size=8)
    (vids / "corrupt.mp4").write_bytes(os.urandom(3000))
    with open(d / "captions.csv", "w", newline="") as f:  # unsorted, a quoted multi-line caption
        csv.writer(f).writerows([("path", "caption"), *reversed(CAPTIONS.items())])
    return d


def _video_args(d, out, *extra):
    return ["--pipeline", str(d / "pipe"), "--media", str(d / "videos"), "--captions", str(d / "captions.csv"),
            "--out", str(out), "--frames", "5", "--height", "16", "--width", "16", "--max-text-len", str(L),
            "--shard-size", "2", "--dtype", "fp32", "--workers", "0", *extra]


@pytest.fixture(scope="module")
def video_run(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("video_out")
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert prepare_data.run(_video_args(setup, out)) == 0
    return out, buf.getvalue()


def _shards(out):
    """{file: ({tensor: value}, metadata)} of every shard under out."""
    res = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("shard_") and name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), framework="pt") as f:
                res[name] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    return res


def _rows(out):
    """{clip path: (latent, cond, text_len)} over all shards."""
    rows = {}
    for tensors, meta in _shards(out).values():
        for i, p in enumerate(json.loads(meta["written"])):
            rows[p] = (tensors["latents"][i], tensors["cond"][i], int(tensors["text_len"][i]))
    return rows


def _wan_pipe(d):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel
    return WanPipeline(tokenizer=AutoTokenizer.from_pretrained(d / "pipe" / "tokenizer"),
                       text_encoder=UMT5EncoderModel.from_pretrained(d / "pipe" / "text_encoder"),
                       vae=AutoencoderKLWan.from_pretrained(d / "pipe" / "vae"),
                       scheduler=FlowMatchEulerDiscreteScheduler())


def _wan_latent(vae, frames_uint8):
    """The oracle: diffusers' posterior mode, normalised as the inverse of pipeline_wan.py's decode step
    (latents / (1 / latents_std) + latents_mean)."""
    x = torch.from_numpy(frames_uint8).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        raw = vae.encode(x).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return ((raw - mean) / std)[0]


@pytest.mark.integration
def test_video_shards_match_diffusers(setup, video_run):
    out, printed = video_run
    pipe = _wan_pipe(setup)
    rows = _rows(out)
    assert sorted(rows) == ["a.gif", "b.mp4", "c.gif"]
    # a.gif: 9 flat frames 20 x 16 -> frames round(linspace(0, 8, 5)) = 0, 2, 4, 6, 8; rows 2:18 (no resize)
    gif = imageio.mimread(setup / "videos" / "a.gif")
    want = np.stack(gif)[[0, 2, 4, 6, 8], 2:18, :, :3]
    torch.testing.assert_close(rows["a.gif"][0], _wan_latent(pipe.vae, want), atol=1e-5, rtol=1e-5)
    gif_c = np.stack(imageio.mimread(setup / "videos" / "c.gif"))[[0, 2, 3, 4, 6], 2:18, :, :3]  # linspace(0, 6, 5)
    torch.testing.assert_close(rows["c.gif"][0], _wan_latent(pipe.vae, gif_c), atol=1e-5, rtol=1e-5)
    # b.mp4 (24 x 32, 12 frames) decoded by ffmpeg through imageio, resized by Pillow: frames 0, 3, 6, 8, 11
    mp4 = np.stack(imageio.mimread(setup / "videos" / "b.mp4"))[[0, 3, 6, 8, 11]]
    ref = np.stack([np.asarray(Image.fromarray(f).resize((21, 16), Image.BILINEAR))[:, 2:18] for f in mp4])
    ours, reason = media.load_clip(str(setup / "videos" / "b.mp4"), 5, 16, 16)
    assert reason == "" and np.abs(ours.numpy().astype(int) - ref).max() <= 3
    torch.testing.assert_close(rows["b.mp4"][0], _wan_latent(pipe.vae, ours.numpy()), atol=1e-5, rtol=1e-5)
    # text: WanPipeline.encode_prompt with the same tiny UMT5 + tokenizer (cleaning, mask, trim, zero re-pad)
    names = ["a.gif", "b.mp4", "c.gif"]
    cond, neg = pipe.encode_prompt([CAPTIONS[n] for n in names], negative_prompt=[DEFAULT_NEGATIVE] * 3,
                                   max_sequence_length=L, device=torch.device("cpu"), dtype=torch.float32)
    lens = pipe.tokenizer([" ".join(CAPTIONS[n].replace("&amp;amp;", "&").split()) for n in names],
                          padding="max_length", max_length=L, truncation=True).attention_mask
    for i, n in enumerate(names):
        torch.testing.assert_close(rows[n][1], cond[i], atol=1e-5, rtol=1e-5)
        assert rows[n][2] == sum(lens[i])
        assert rows[n][1][rows[n][2]:].abs().sum() == 0 and (rows[n][1][:rows[n][2]].abs().sum(-1) > 0).all()
    assert [rows[n][2] for n in names] == [6, 4, L]  # "a cat & dog runs </s>", "the red ball </s>", truncated
    with safe_open(os.path.join(out, "negative.safetensors"), framework="pt") as f:
        torch.testing.assert_close(f.get_tensor("cond"), neg[0], atol=1e-5, rtol=1e-5)
    # skipped files: in report.json with reasons, and in the printed summary
    report = json.loads((out / "report.json").read_text())
    reasons = {s["path"]: s["reason"] for s in report["skipped"]}
    assert sorted(reasons) == ["corrupt.mp4", "missing.webm", "short.gif"]
    assert reasons["corrupt.mp4"].startswith("unreadable") and reasons["missing.webm"] == "missing file"
    assert reasons["short.gif"].startswith("too short: 3 frames")
    assert report["clips_written"] == 3 and report["clips_total"] == 6 and report["shards"] == 3
    for p, r in reasons.items():
        assert f"{p}: {r}" in printed
    assert "3 of 6 clips written" in printed and "clips/s" in printed


def test_shard_dataset_opens_output(video_run):
    out, _ = video_run
    index = json.loads((out / "index.json").read_text())
    # sorted clips: a.gif b.mp4 | c.gif corrupt.mp4 | missing.webm short.gif -> the last shard is empty, unlisted
    assert index["shards"] == [{"file": "shard_00000.safetensors", "num_samples": 2},
                               {"file": "shard_00001.safetensors", "num_samples": 1}]
    assert index["latent_shape"] == [4, 2, 2, 2] and index["cond_shape"] == [L, 16]
    ds = ShardDataset(str(out))
    rows = _rows(out)
    assert len(ds) == 3 and ds.cond_shape == (L, 16) and ds.channels == 4
    x, cond = ds.get_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(x, torch.stack([rows["c.gif"][0], rows["a.gif"][0]]))
    torch.testing.assert_close(cond, torch.stack([rows["c.gif"][1], rows["a.gif"][1]]))
    with safe_open(os.path.join(out, "negative.safetensors"), framework="pt") as f:
        torch.testing.assert_close(ds.negative, f.get_tensor("cond"))


def test_image_shards_match_autoencoder_kl(setup, tmp_path):
    from diffusers import AutoencoderKL
    out = tmp_path / "img"
    args = ["--vae", str(setup / "klvae"), "--text-encoder", str(setup / "pipe" / "text_encoder"),
            "--media", str(setup / "images"), "--captions", str(setup / "images" / "captions.jsonl"),
            "--out", str(out), "--height", "16", "--width", "16", "--max-text-len", str(L), "--workers", "0",
            "--dtype", "fp32", "--text-batch-size", "2"]
    assert prepare_data.run(args) == 0
    rows = _rows(out)
    vae = AutoencoderKL.from_pretrained(setup / "klvae")
    for name in ("p1.png", "p2.png"):  # 16 x 16 as is; 16 x 24 -> columns 4:20, no resize
        img = np.asarray(Image.open(setup / "images" / name))[:, :16] if name == "p1.png" else \
            np.asarray(Image.open(setup / "images" / name))[:, 4:20]
        x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            want = (vae.encode(x).latent_dist.mode() - 0.1) * 0.5  # (x - shift_factor) * scaling_factor
        torch.testing.assert_close(rows[name][0], want[0], atol=1e-5, rtol=1e-5)
    assert rows["p3.png"][0].shape == (4, 2, 2)
    assert ShardDataset(str(out)).spatial == (2, 2)


def _documented_report_fields() -> set:
    """The first column of docs/prepare_data.md's report.json table: the fields a user is told exist."""
    text = open(DOCS, encoding="utf-8").read()
    at = text.find("`report.json` has these fields")
    table = re.search(r"\n\| field \| value \|\n\|---\|---\|\n((?:\|.*\n)+)", text[at:]) if at >= 0 else None
    assert table, f"{DOCS}: no '| field | value |' table after '`report.json` has these fields'"
    rows = table.group(1).splitlines()
    names = [re.match(r"\| `([^`]+)` \| [^|]+ \|$", row) for row in rows]
    assert all(names), f"{DOCS}: report.json rows not of the form '| `name` | value |': " \
                       f"{[r for r, n in zip(rows, names) if not n]}"
    return {n.group(1) for n in names}


def _report_keys(report: dict) -> set:
    """report.json's keys, plus `name[].key` for each key of the entries of a list (`settings` is one field)."""
    keys = set(report)
    for name, value in report.items():
        if isinstance(value, list):
            keys |= {f"{name}[].{k}" for entry in value if isinstance(entry, dict) for k in entry}
    return keys


def test_report_json_fields_are_the_documented_ones(tiny_models, tmp_path):
    """Every key a run writes to report.json is in docs/prepare_data.md's table and every field there is written,
    so a field added, renamed or dropped without the docs fails here (issue 53 item 4). The run leaves out a
    malformed caption row and a missing file, so both lists have entries and their keys are compared too; a run
    without captions (class folders, prepare_trajectories: `build_report` with no source) writes all but the
    caption_rows_* fields, as the docs say."""
    captions = tmp_path / "captions.csv"
    captions.write_text("path,caption\np1.png,a cat\np2.png,a cat, runs\nmissing.png,a dog\n")  # line 3: 3 fields
    out = tmp_path / "out"
    args = ["--vae", str(tiny_models / "klvae"), "--text-encoder", str(tiny_models / "pipe" / "text_encoder"),
            "--media", str(tiny_models / "images"), "--captions", str(captions), "--out", str(out),
            "--height", "16", "--width", "16", "--max-text-len", str(L), "--workers", "0", "--dtype", "fp32",
            "--skip-bad-captions"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert prepare_data.run(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert [b["line"] for b in report["caption_rows_skipped"]] == [3]
    assert [(s["path"], s["reason"]) for s in report["skipped"]] == [("missing.png", "missing file")]
    written, documented = _report_keys(report), _documented_report_fields()
    assert written == documented, (f"report.json keys missing from {DOCS}'s table: {sorted(written - documented)}; "
                                   f"documented but not written: {sorted(documented - written)}")
    no_captions = build_report(read_shard_headers(str(out), report["shards"]), set(), 1.0, 1, {})  # skipped too
    assert _report_keys(no_captions) == {f for f in documented if not f.startswith("caption_rows_")}


@pytest.mark.integration
def test_sample_posterior_is_per_clip(setup, video_run, tmp_path):
    mean_rows = _rows(video_run[0])
    runs = []
    for name, extra in (("s2", ["--batch-size", "1"]), ("s4", ["--shard-size", "4", "--batch-size", "2"])):
        args = _video_args(setup, tmp_path / name, "--sample-posterior", "--seed", "3", *extra)  # last flag wins
        assert prepare_data.run(args) == 0
        runs.append(_rows(tmp_path / name))
    assert sorted(runs[0]) == sorted(runs[1]) == sorted(mean_rows)
    for p in mean_rows:
        torch.testing.assert_close(runs[0][p][0], runs[1][p][0], atol=1e-5, rtol=1e-5)  # batch 1 vs 2: ulps
        assert not torch.allclose(runs[0][p][0], mean_rows[p][0], atol=1e-3)
        torch.testing.assert_close(runs[0][p][1], mean_rows[p][1])


def test_latent_vae_decode_and_posterior_draw(setup):
    pipe = _wan_pipe(setup)
    vae = LatentVAE.from_folder(str(setup / "pipe" / "vae"))
    assert (vae.kind, vae.latent_channels, vae.spatial_factor, vae.temporal_factor) == ("wan", 4, 8, 4)
    assert vae.latent_shape(9, 16, 24) == (4, 3, 2, 3)
    torch.manual_seed(1)
    z = torch.randn(2, 4, 2, 2, 3)
    # pipeline_wan.py decode step: latents / (1 / latents_std) + latents_mean, then vae.decode
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        want = pipe.vae.decode(z / (1.0 / std) + mean).sample.clamp(-1, 1)
    torch.testing.assert_close(vae.decode(z), want, atol=1e-5, rtol=1e-5)
    pixels = torch.rand(2, 3, 5, 16, 24) * 2 - 1
    eps = torch.randn(2, 4, 2, 2, 3)
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
    torch.testing.assert_close(vae.encode(pixels, eps), (post.mean + post.std * eps - mean) / std,
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="--frames 6: .* 4k \\+ 1"):
        vae.encode(torch.zeros(1, 3, 6, 16, 16))
    with pytest.raises(ConfigError, match="--my-vae .*not a directory"):
        LatentVAE.from_folder(str(setup / "nope"), flag="--my-vae")


def test_resize_crop_and_frame_indices():
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)
    # 30 x 50 -> cover 16 x 16: x 16/30 -> 16 x 27, centre columns 5:21; Pillow's bilinear as the reference
    ref = np.asarray(Image.fromarray(img).resize((27, 16), Image.BILINEAR))[:, 5:21]
    ours = media.resize_crop(torch.from_numpy(img)[None], 16, 16)[0].numpy()
    assert ours.shape == (16, 16, 3) and np.abs(ours.astype(int) - ref).max() <= 2
    assert media.frame_indices(9, 5).tolist() == [0, 2, 4, 6, 8]
    assert media.frame_indices(100, 4, source_fps=30.0, fps=10.0).tolist() == [0, 3, 6, 9]
    with pytest.raises(Exception, match="too short: 9 frames at 30 fps"):
        media.frame_indices(9, 4, source_fps=30.0, fps=10.0)


@pytest.mark.parametrize("extra, line", [
    (["--frames", "6"], "ConfigError: --frames 6: the VAE"),
    (["--height", "30"], "ConfigError: --height 30: the VAE"),
    (["--width", "4"], "ConfigError: --width 4: the VAE"),
    (["--shard-size", "0"], "ConfigError: --shard-size 0: expected an integer >= 1"),
    (["--captions", "BADCAPTIONS"], "DataError: --captions"),
])
def test_bad_flags_fail_before_any_work(setup, tmp_path, capsys, monkeypatch, extra, line):
    from dmd2_mega.prep import run as prep_run

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")
    monkeypatch.setattr(prep_run.LatentVAE, "from_folder", loaded)
    monkeypatch.setattr(prep_run.TextEncoder, "from_folder", loaded)
    if extra[-1] == "BADCAPTIONS":  # an image listed for a 5-frame video VAE
        bad = tmp_path / "bad.csv"
        bad.write_text("path,caption\na.gif,x\npic.png,y\n")
        extra = ["--captions", str(bad)]
    out = tmp_path / "out"
    assert prepare_data.run(_video_args(setup, out, *extra)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
    if "--frames" in line:
        assert "4k + 1" in err[0]
    if "--height" in line:
        assert "multiple of its spatial factor 8" in err[0]
    if line.startswith("DataError"):
        assert "line 3" in err[0] and "pic.png" in err[0]
    assert not out.exists()


def test_prompts_only_matches_wan_pipeline(setup, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat runs\n\n  the  blue sky \n")
    out = tmp_path / "eval.safetensors"
    assert prepare_data.run(["--prompts-only", "--pipeline", str(setup / "pipe"), "--prompts", str(prompts),
                             "--out", str(out), "--max-text-len", str(L), "--dtype", "fp32",
                             "--negative-prompt", "dog"]) == 0
    p = read_prompts(str(out), cond_shape=(L, 16))
    assert p.texts == ["a cat runs", "the  blue sky"]
    cond, neg = _wan_pipe(setup).encode_prompt(p.texts, negative_prompt=["dog", "dog"], max_sequence_length=L,
                                               device=torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(p.cond, cond, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p.negative, neg[0], atol=1e-5, rtol=1e-5)


KILL_RANK_1 = r'''
import os, runpy, signal, sys, time
sys.path.insert(0, {root!r})
import dmd2_mega.prep.writer as writer
real = writer.atomic_write

def atomic_write(path, write, **kw):
    if os.environ["RANK"] != "1" or "shard_" not in os.path.basename(path):
        return real(path, write, **kw)
    out, t0 = os.path.dirname(path), time.time()
    while not all(os.path.exists(os.path.join(out, f"shard_0000{{k}}.safetensors")) for k in (0, 2)):
        assert time.time() - t0 < 120, "rank 0 never wrote its shards"
        time.sleep(0.05)

    class Half:  # write half the shard into atomic_write's temp file, then die as a node failure would
        def __init__(self, f):
            self.f = f
        def write(self, blob):
            self.f.write(blob[:len(blob) // 2]); self.f.flush(); os.fsync(self.f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    return real(path, lambda f: write(Half(f)), **kw)

writer.atomic_write = atomic_write
sys.argv = [{launch!r}] + sys.argv[1:]
runpy.run_path({launch!r}, run_name="__main__")
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.integration
def test_killed_two_rank_run_resumes_to_the_same_output(setup, video_run, tmp_path):
    """Rank 1 of a 2-rank job (gloo; the environment torchrun gives: RANK, WORLD_SIZE, MASTER_ADDR/PORT) owns
    shard 1; it is SIGKILLed halfway through writing it, after rank 0 wrote shards 0 and 2 and went to the
    barrier, and rank 0 is then killed as torchrun's agent would. A 1-rank re-run keeps shards 0 and 2, writes
    shard 1, and the whole output equals the uninterrupted 1-rank run: 2 ranks write what 1 rank writes, and a
    kill leaves no partial shard. (The ranks are started directly: torchrun's agent would cost one more
    interpreter start-up.)"""
    ref_out, _ = video_run
    out = tmp_path / "out"
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1.format(root=ROOT, launch=LAUNCH))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(script), *_video_args(setup, out)], stdout=logs[r],
                              stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    try:
        rc1 = procs[1].wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    log = "".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))
    assert rc1 == -signal.SIGKILL, log
    names = sorted(os.listdir(out))
    assert "shard_00000.safetensors" in names and "shard_00002.safetensors" in names, (names, log)
    assert "shard_00001.safetensors" not in names and "index.json" not in names
    assert any(n.startswith("shard_00001.safetensors.") and n.endswith(".tmp") for n in names), names
    before = {n: (out / n).stat().st_mtime_ns for n in ("shard_00000.safetensors", "shard_00002.safetensors")}

    assert prepare_data.run(_video_args(setup, out)) == 0
    names = sorted(os.listdir(out))
    assert not any(n.endswith(".tmp") for n in names), names
    assert {n: (out / n).stat().st_mtime_ns for n in before} == before  # kept, not rewritten
    assert json.loads((out / "report.json").read_text())["shards_resumed"] == [0, 2]
    ref, got = _shards(ref_out), _shards(out)
    assert sorted(ref) == sorted(got)
    for name in ref:
        assert ref[name][1] == got[name][1]
        for k in ref[name][0]:
            assert torch.equal(ref[name][0][k], got[name][0][k]), (name, k)
    for f in ("index.json", "negative.safetensors"):
        assert (ref_out / f).read_bytes() == (out / f).read_bytes()
    # a third run with other settings refuses to mix them into the same --out
    assert prepare_data.run(_video_args(setup, out, "--fps", "8")) == 1
