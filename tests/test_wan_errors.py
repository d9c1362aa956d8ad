"""Bad real-model input is one line naming the file or flag, and nothing is written (issue: Wan family, item 7).

Each case runs the real entry point (`launch/convert_checkpoint.py`'s main in process, `launch/pretrain_dmd2.py` as
a subprocess) on a tiny random diffusers folder built here and checks the exit status, the one stderr line and that --save holds no checkpoint:
a folder of another model class, an image-to-video config, a missing shard of a sharded folder, a truncated
shard, weights that disagree with config.json, a TP size that does not divide the heads, a text-embedding width
that is not the model's text_dim, and a --model-size path without a config.json.
"""
import contextlib
import io
import json
import os
import warnings

from diffusers import WanTransformer3DModel
import pytest
import torch

from dmd2_mega.data import write_shards
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import DataShape, build_model, get_size, get_spec
from dmd2_mega.pretrained import import_diffusers
from dmd2_mega.train.resilience import run_main
from launch.convert_checkpoint import main as convert_main, parse_args
from tests.utils import PRETRAIN_DMD2, python, world_of_one

pytestmark = pytest.mark.timeout(300)


def tiny_wan(path, **over):
    cfg = {**get_spec("wan-debug").diffusers_config(), **over}
    cfg.pop("_class_name")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        WanTransformer3DModel(**cfg).save_pretrained(path, max_shard_size="40KB")  # several shards + an index
    return path


def fails(args, *needles, save=None):
    """`launch/convert_checkpoint.py args` in process (its main under run_main, as __main__ runs it): exit 1 and
    ONE stderr line holding every needle; nothing under `save`."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's own deprecation warnings (PYTHONWARNINGS hides them in runs)
        rc = run_main(lambda: convert_main(parse_args([str(a) for a in args])))
    lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1, err.getvalue()
    for n in needles:
        assert n in lines[0], lines[0]
    if save is not None:
        assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
        assert not os.path.isdir(os.path.join(save, "iter_0000000"))
    return lines[0]


def test_folder_of_another_model_class(tmp_path):
    """A model class no family reads is one line naming the folder and the families tried, for a conversion and
    for --model-size (a DiTTransformer2DModel goes to the DiT family: test_dit_import)."""
    (tmp_path / "pixart").mkdir()
    with open(tmp_path / "pixart" / "config.json", "w") as f:
        json.dump({"_class_name": "PixArtTransformer2DModel", "num_layers": 1}, f)
    line = fails(["--from-diffusers", tmp_path / "pixart", "--save", tmp_path / "out"], str(tmp_path / "pixart"),
                 "no model family reads", "'PixArtTransformer2DModel'", save=tmp_path / "out")
    assert "tried dit: " in line and "; wan: " in line, line  # the families tried, never a fall-through to one
    with pytest.raises(ConfigError, match="no model family recognises .*PixArtTransformer2DModel.*tried dit: "):
        get_size(str(tmp_path / "pixart"))
    (tmp_path / "empty").mkdir()
    fails(["--from-diffusers", tmp_path / "empty", "--save", tmp_path / "out"], "no config.json")


@pytest.mark.parametrize("change, words", [
    ({"pos_embed_seq_len": 514}, ("pos_embed_seq_len=514", "FLF2V", "not supported")),
    ({"image_dim": 1280, "added_kv_proj_dim": 24}, ("image_dim 1280", "in_channels = 2 out_channels + 4")),
    ({"image_dim": 1280}, ("image_dim=1280 with added_kv_proj_dim=None",))])
def test_configs_the_family_does_not_build_are_refused(tmp_path, change, words):
    d = tiny_wan(tmp_path / "wan")
    cfg = json.load(open(d / "config.json"))
    json.dump({**cfg, **change}, open(d / "config.json", "w"))
    fails(["--from-diffusers", d, "--save", tmp_path / "out"], *words, save=tmp_path / "out")


def test_missing_and_truncated_shards(tmp_path):
    d = tiny_wan(tmp_path / "wan")
    shards = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.isfile(d / "diffusion_pytorch_model.safetensors.index.json")
    data = (d / shards[1]).read_bytes()
    (d / shards[1]).write_bytes(data[: len(data) // 2])
    fails(["--from-diffusers", d, "--save", tmp_path / "out"], shards[1], "truncated or corrupt",
          save=tmp_path / "out")
    os.remove(d / shards[1])
    fails(["--from-diffusers", d, "--save", tmp_path / "out"], shards[1], "missing", save=tmp_path / "out")


def test_weights_that_disagree_with_the_config(tmp_path):
    d = tiny_wan(tmp_path / "wan")
    cfg = json.load(open(d / "config.json"))
    json.dump({**cfg, "ffn_dim": 64}, open(d / "config.json", "w"))
    fails(["--from-diffusers", d, "--save", tmp_path / "out"], "ffn.net.0.proj", "config.json implies",
          "weights and config disagree", save=tmp_path / "out")
    json.dump({**cfg, "num_layers": 3}, open(d / "config.json", "w"))
    fails(["--from-diffusers", d, "--save", tmp_path / "out"], "are in none of its weight files",
          save=tmp_path / "out")


def test_tp_that_does_not_divide_the_heads(tmp_path):
    d = tiny_wan(tmp_path / "wan")
    fails(["--from-diffusers", d, "--save", tmp_path / "out", "--tensor-model-parallel-size", "4"],
          "--tensor-model-parallel-size 4 must divide the 2 attention heads", save=tmp_path / "out")
    with world_of_one(), pytest.raises(ConfigError, match="--tensor-model-parallel-size 4 must divide"):
        build_model("wan-debug", DataShape(4, (1, 2, 2), cond_shape=(3, 16)), tp_size=4)


@pytest.mark.integration
def test_text_width_and_model_size_path(tmp_path):
    d = tiny_wan(tmp_path / "wan")
    import_diffusers(str(d), str(tmp_path / "teacher"), log=lambda *_: None)
    write_shards(str(tmp_path / "data"), torch.randn(4, 4, 1, 2, 2), cond=torch.randn(4, 3, 8))
    r = python(PRETRAIN_DMD2, ["--model-size", tmp_path / "teacher", "--teacher-load", tmp_path / "teacher",
                               "--data", tmp_path / "data", "--train-iters", "1", "--micro-batch-size", "2",
                               "--save", tmp_path / "run"])
    assert r.returncode == 1 and "text embeddings are 8 wide" in r.stderr and "text_dim 16" in r.stderr, r.tail()
    assert not os.path.exists(tmp_path / "run" / "latest_checkpointed_iteration.txt")
    with pytest.raises(ConfigError, match="--model-size .*data: no config.json in that folder"):
        get_size(str(tmp_path / "data"))
