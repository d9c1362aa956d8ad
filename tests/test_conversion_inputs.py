"""Conversion refuses bad weights and bad output paths with one line, and writes nothing (issue 27, items 9 and 6).

Bad weights (item 9), on tiny sharded diffusers folders (a Wan and a DiT model saved in 40 KB shards) and tiny
official SiT / DiT state dicts, all built here:
  * a tensor that a later shard holds again (an all-zero proj_out: read in shard order, the zeros would replace
    the trained weights) is refused naming both files and the tensor;
  * a NaN or an inf weight, in a diffusers shard or an official .pt, is refused naming the file and the tensor;
  * an index whose weight_map sends a tensor to "../x.safetensors" or an absolute path (a real file outside the
    folder) is refused naming the index and the tensor, never read;
  * an official .pt saved in fp16 or bf16 converts, and its weights equal the fp32 file's within that dtype's
    rounding; a pos_embed that is genuinely wrong (one entry off by 1e-2, tokens shuffled) is still refused.
Bad paths and configs (item 6): --save an existing file, --save / --to-diffusers under a file, --save equal to
the input, --to-diffusers a file, and a config.json whose num_layers is "two" or -1 or which holds a JSON list
(Wan and DiT) are each ONE stderr line, exit 1, naming the flag / file / key and what was expected, with no file
under the test's folder created or changed. The typed reads still take what diffusers itself holds: a model's
in-memory config gives patch_size as a tuple, which reads as the JSON list does.

Every case runs `launch/convert_checkpoint.py`'s main in process (`test_export_atomic.convert`).
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import get_spec
from dmd2_mega.models.wan import DIFFUSERS_CLASS, WanSpec
from dmd2_mega.pretrained import import_diffusers, load_model
from tests.test_dit_import import HEADS, diffusers_dit, official_state
from tests.test_export_atomic import convert
from tests.test_wan_errors import tiny_wan
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture(scope="module", autouse=True)
def world():
    with world_of_one() as ps:
        yield ps


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{"wan", "dit": pristine sharded diffusers folders; "teacher": the Wan one converted}."""
    d = tmp_path_factory.mktemp("conversion_inputs")
    tiny_wan(d / "wan")
    diffusers_dit().save_pretrained(d / "dit", max_shard_size="40KB")
    import_diffusers(str(d / "wan"), str(d / "teacher"), log=lambda *_: None)
    return {k: d / k for k in ("wan", "dit", "teacher")}


def copy(made, tmp_path, family: str):
    return shutil.copytree(made[family], tmp_path / family)


def snapshot(root) -> dict:
    return {os.path.join(r, n): (os.path.getsize(os.path.join(r, n)), os.path.getmtime(os.path.join(r, n)))
            for r, ds, files in os.walk(root) for n in files + ds}


def refused(args, root, *needles, kind=None) -> str:
    """`convert(args)` exits 1 with ONE stderr line (`kind: ...`) holding every needle, and nothing under `root`
    is created, removed or rewritten."""
    before = snapshot(root)
    rc, _, err = convert(args)
    assert rc == 1 and len(err) == 1, err
    line = err[0]
    if kind is not None:
        assert line.startswith(f"{kind}: "), line
    for n in needles:
        assert str(n) in line, (n, line)
    assert snapshot(root) == before
    return line


def weight_map(folder) -> dict:
    with open(folder / INDEX) as f:
        return json.load(f)["weight_map"]


def rewrite_index(folder, wm: dict) -> None:
    with open(folder / INDEX) as f:
        index = json.load(f)
    with open(folder / INDEX, "w") as f:
        json.dump({**index, "weight_map": wm}, f)


def edit_shard(path, fn) -> None:
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def repeat_in_later_shard(folder, key: str) -> tuple:
    """Puts `key` in the first shard and an all-zero copy of it in the last one (the index keeps naming the
    first); returns (first, last) shard paths."""
    wm = weight_map(folder)
    shards = sorted(set(wm.values()))
    assert len(shards) > 1
    first, last = folder / shards[0], folder / shards[-1]
    t = load_file(folder / wm[key])[key]
    edit_shard(first, lambda s: s.update({key: t}))
    rewrite_index(folder, {**wm, key: shards[0]})
    edit_shard(last, lambda s: s.update({key: torch.zeros_like(t)}))
    return first, last


@pytest.mark.parametrize("family,key", [("wan", "proj_out.weight"), ("dit", "proj_out_2.weight")])
def test_tensor_repeated_in_a_later_shard(made, tmp_path, family, key):
    src = copy(made, tmp_path, family)
    first, last = repeat_in_later_shard(src, key)
    refused(["--from-diffusers", src, "--save", tmp_path / "out"], tmp_path, first, last, repr(key),
            kind="CheckpointError")
    edit_shard(last, lambda s: s.pop(key))
    rc, _, err = convert(["--from-diffusers", src, "--save", tmp_path / "out"])
    assert rc == 0 and err == [], err


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_in_a_shard(made, tmp_path, bad):
    src = copy(made, tmp_path, "wan")
    key = "blocks.1.attn1.to_q.weight"
    shard = src / weight_map(src)[key]

    def poison(s):
        s[key][3, 5] = bad
    edit_shard(shard, poison)
    refused(["--from-diffusers", src, "--save", tmp_path / "out"], tmp_path, shard, repr(key), "NaN / inf",
            kind="CheckpointError")


@pytest.mark.parametrize("outside", ["../x.safetensors", "absolute"])
def test_index_entry_outside_the_folder(made, tmp_path, outside):
    src = copy(made, tmp_path, "wan")
    wm = weight_map(src)
    moved = sorted(set(wm.values()))[1]
    shutil.move(src / moved, tmp_path / "x.safetensors")
    name = str(tmp_path / "x.safetensors") if outside == "absolute" else outside
    rewrite_index(src, {k: name if v == moved else v for k, v in wm.items()})
    refused(["--from-diffusers", src, "--save", tmp_path / "out"], tmp_path, src / INDEX, repr(name), "outside",
            kind="CheckpointError")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_official_file_converts(tmp_path, dtype):
    state = official_state()
    torch.save(state, tmp_path / "fp32.pt")
    torch.save({k: v.to(dtype) for k, v in state.items()}, tmp_path / "half.pt")
    rc, _, err = convert(["--from-official", tmp_path / "half.pt", "--parameterization", "sit",
                          "--num-heads", HEADS, "--save", tmp_path / "out"])
    assert rc == 0 and err == [], err
    got = dict(load_model(str(tmp_path / "out")).named_parameters())
    want = dict(load_model(str(tmp_path / "fp32.pt"), parameterization="sit", num_heads=HEADS).named_parameters())
    assert set(got) == set(want)
    ulp = torch.finfo(dtype).eps / 2
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=ulp, atol=torch.finfo(dtype).smallest_normal * ulp, msg=n)


def _one_entry_off(t):
    t = t.clone()
    t[0, 5, 7] += 1e-2
    return t


def _shuffled(t):
    return t[:, torch.randperm(t.shape[1], generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("wrong", [_one_entry_off, _shuffled])
def test_wrong_pos_table_is_refused(tmp_path, dtype, wrong):
    state = {k: v.to(dtype) for k, v in official_state().items()}
    state["pos_embed"] = wrong(state["pos_embed"])
    torch.save(state, tmp_path / "pos.pt")
    refused(["--from-official", tmp_path / "pos.pt", "--parameterization", "sit", "--num-heads", HEADS,
             "--save", tmp_path / "out"], tmp_path, tmp_path / "pos.pt", "pos_embed is not the fixed sin-cos table",
            kind="CheckpointError")


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_weight_in_an_official_file(tmp_path, bad):
    state = official_state()
    state["blocks.0.attn.qkv.weight"][1, 2] = bad
    torch.save({"model": {}, "ema": state}, tmp_path / "sit.pt")
    refused(["--from-official", tmp_path / "sit.pt", "--parameterization", "sit", "--num-heads", HEADS,
             "--save", tmp_path / "out"], tmp_path, tmp_path / "sit.pt", "'blocks.0.attn.qkv.weight'", "NaN / inf",
            kind="CheckpointError")


def test_save_an_existing_file(made, tmp_path):
    (tmp_path / "taken").write_text("keep")
    refused(["--from-diffusers", made["wan"], "--save", tmp_path / "taken"], tmp_path,
            f"--save {tmp_path / 'taken'} is a file", "expected a directory", kind="ConfigError")


@pytest.mark.parametrize("flag", ["--save", "--to-diffusers"])
def test_output_under_a_file(made, tmp_path, flag):
    (tmp_path / "taken").write_text("keep")
    out = tmp_path / "taken" / "out"
    args = ["--from-diffusers", made["wan"]] if flag == "--save" else ["--load", made["teacher"]]
    refused([*args, flag, out], tmp_path, f"{flag} {out} lies under {tmp_path / 'taken'}, which is not a directory",
            "expected a path under a directory", kind="ConfigError")


def test_save_equal_to_the_input(made, tmp_path):
    src = copy(made, tmp_path, "wan")
    refused(["--from-diffusers", src, "--save", src], tmp_path, f"--save {src} is --from-diffusers {src}",
            kind="ConfigError")
    torch.save(official_state(), tmp_path / "sit.pt")
    refused(["--from-official", tmp_path / "sit.pt", "--parameterization", "sit", "--save", tmp_path / "sit.pt"],
            tmp_path, f"--save {tmp_path / 'sit.pt'} is --from-official", kind="ConfigError")


def test_to_diffusers_a_file(made, tmp_path):
    (tmp_path / "taken").write_text("keep")
    refused(["--load", made["teacher"], "--to-diffusers", tmp_path / "taken"], tmp_path,
            f"--to-diffusers {tmp_path / 'taken'} is a file", "expected a directory", kind="ConfigError")


@pytest.mark.parametrize("family", ["wan", "dit"])
@pytest.mark.parametrize("value", ["two", -1])
def test_config_num_layers_not_a_count(made, tmp_path, family, value):
    src = copy(made, tmp_path, family)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_layers": value}))
    refused(["--from-diffusers", src, "--save", tmp_path / "out"], tmp_path, src,
            f"config.json's num_layers is {value!r}; expected an integer >= 1", kind="ConfigError")


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_config_that_is_a_json_list(made, tmp_path, family):
    src = copy(made, tmp_path, family)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps([config]))
    refused(["--from-diffusers", src, "--save", tmp_path / "out"], tmp_path, src / "config.json",
            "holds a JSON list", "expected a JSON object", kind="ConfigError")


def test_patch_size_as_diffusers_holds_it():
    from diffusers import WanTransformer3DModel
    config = get_spec("wan-debug").diffusers_config()
    assert isinstance(config["patch_size"], list)
    ref = WanTransformer3DModel(**{k: v for k, v in config.items() if k not in ("_class_name", "patch_size")})
    assert ref.config["patch_size"] == (1, 2, 2)
    spec = WanSpec.from_config({**ref.config, "_class_name": DIFFUSERS_CLASS}, "ref")
    assert spec == WanSpec.from_config(config, "ref") and spec.patch_size == (1, 2, 2)
    for bad in ([1, 2], (1, 2, 0), [1, 2.0, 2], "1,2,2"):
        with pytest.raises(ConfigError, match=r"ref: config.json's patch_size is .*; expected a list of 3 values"):
            WanSpec.from_config({**config, "patch_size": bad}, "ref")
