"""No output over an input (dmd2_mega/files/path_guard.py): the shared check and every entry point that runs it, in
process (each entry point's flag parsing / main raises before anything is written), with the input's bytes
checked unchanged."""
import os

import pytest

from dmd2_mega.config import TrainConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.files.path_guard import check_outputs_apart, relation
from launch import convert_checkpoint, eval_fid, prepare_data, sample


def _file(path, data=b"reference bytes"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_relation_resolves_symlinks_dots_and_missing_outputs(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    os.symlink(data, tmp_path / "link")
    assert relation(str(tmp_path / "link"), str(data)) == "is"
    assert relation(str(tmp_path / "link" / "new" / "deeper"), str(data)) == "lies inside"  # not there yet
    assert relation(str(tmp_path / "data" / ".." / "data" / "sub"), str(data)) == "lies inside"
    assert relation(str(tmp_path), str(data / "sub")) == "contains"
    assert relation(str(tmp_path / "data2"), str(data)) is None  # a shared name prefix is not inside
    assert relation(str(tmp_path / "out"), str(data)) is None


def test_only_existing_inputs_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_outputs_apart([("--save", ".")], [("--data", "digits"), ("--load", None)])  # names, not paths
    _file(tmp_path / "digits")
    with pytest.raises(ConfigError, match=r"--save \. contains --data digits, an input of this run: .*choose "
                                          r"another --save \(nothing was written\)"):
        check_outputs_apart([("--save", ".")], [("--data", "digits")])


def test_eval_fid_save_stats_never_replaces_the_reference(tmp_path):
    ref = _file(tmp_path / "R.npz")
    args = ["--load", str(tmp_path / "ckpt"), "--ref-stats", ref, "--inception-weights", str(tmp_path / "i.pt"),
            "--num-samples", "10"]
    eval_fid.parse(args + ["--save-stats", str(tmp_path / "mine.npz")])  # apart: accepted
    with pytest.raises(ConfigError, match=r"--save-stats .*R\.npz is --ref-stats .*R\.npz"):
        eval_fid.parse(args + ["--save-stats", ref])
    with pytest.raises(ConfigError, match=r"--out .* contains --ref-stats"):
        eval_fid.parse(args + ["--out", str(tmp_path)])
    assert open(ref, "rb").read() == b"reference bytes"


def test_prepare_prompts_never_overwrite_the_prompts(tmp_path, capsys):
    prompts = _file(tmp_path / "P.txt", b"a cat\n")
    enc = tmp_path / "text_encoder"
    enc.mkdir()
    assert prepare_data.run(["--prompts-only", "--text-encoder", str(enc), "--prompts", prompts,
                             "--out", prompts]) == 1
    assert "ConfigError: --out" in capsys.readouterr().err and open(prompts, "rb").read() == b"a cat\n"


@pytest.mark.parametrize("where", ["media", "pipeline"])
def test_prepare_data_out_never_inside_its_inputs(tmp_path, capsys, where):
    media, pipeline = tmp_path / "clips", tmp_path / "pipe"
    for d in (media, pipeline / "vae", pipeline / "text_encoder"):
        d.mkdir(parents=True)
    captions = _file(media / "captions.csv", b"path,caption\na.gif,a cat\n")
    out = (media if where == "media" else pipeline) / "shards"
    assert prepare_data.run(["--pipeline", str(pipeline), "--media", str(media), "--captions", captions,
                             "--out", str(out)]) == 1
    flag = "--media" if where == "media" else "--pipeline"
    assert f"lies inside {flag}" in capsys.readouterr().err and not out.exists()


def test_sample_out_never_the_checkpoint(tmp_path):
    ckpt = tmp_path / "student"
    _file(ckpt / "latest_checkpointed_iteration.txt", b"3")
    with pytest.raises(ConfigError, match=r"--out .*student is --load"):
        sample.parse(["--load", str(ckpt), "--out", str(ckpt)])
    with pytest.raises(ConfigError, match=r"--out .* lies inside --load"):
        sample.parse(["--load", str(ckpt), "--out", str(ckpt / "samples")])
    sample.parse(["--load", str(ckpt), "--out", str(tmp_path / "samples")])


def test_conversion_never_writes_into_its_source(tmp_path):
    src = tmp_path / "Wan-Diffusers"
    _file(src / "transformer" / "config.json", b"{}")
    for save in (src / "ours", src):
        with pytest.raises(ConfigError, match=r"--save .* (lies inside|is) --from-diffusers"):
            convert_checkpoint.main(convert_checkpoint.parse_args(["--from-diffusers", str(src), "--save", str(save)]))
    ckpt = tmp_path / "run"
    _file(ckpt / "latest_checkpointed_iteration.txt", b"1")
    with pytest.raises(ConfigError, match=r"--to-diffusers .* lies inside --load"):
        convert_checkpoint.main(convert_checkpoint.parse_args(["--load", str(ckpt), "--to-diffusers",
                                                               str(ckpt / "export")]))
    assert sorted(os.listdir(src)) == ["transformer"] and sorted(os.listdir(ckpt)) == [
        "latest_checkpointed_iteration.txt"]


def test_trainer_outputs_apart_from_data_and_a_foreign_load(tmp_path):
    data, run, other = tmp_path / "shards", tmp_path / "run", tmp_path / "other"
    for d in (data, run, other):
        d.mkdir()
    with pytest.raises(ConfigError, match=r"--save .* lies inside --data"):
        TrainConfig(data=str(data), save=str(data / "run")).check_paths_apart()
    with pytest.raises(ConfigError, match=r"--tensorboard-dir .* lies inside --load"):
        TrainConfig(data=str(data), save=str(run), load=str(other), tensorboard_dir=str(other / "tb")).check_paths_apart()
    # a resume (--load = --save) may keep its logs inside its own directory
    TrainConfig(data=str(data), save=str(run), load=str(run), tensorboard_dir=str(run / "tb"),
                loss_trace=str(run / "trace.jsonl")).check_paths_apart()
    (tmp_path / "x_critic").mkdir()
    with pytest.raises(ConfigError, match=r"--save's critic directory .* is --data"):
        TrainConfig(data=str(tmp_path / "x_critic"), save=str(tmp_path / "x")).check_paths_apart(
            [("--save's critic directory", str(tmp_path / "x_critic"))])
