"""DMD2 on an image-to-video Wan teacher (issue 32; `models/wan/image.py`): a teacher converted from a tiny random
diffusers Wan 2.1 I2V transformer (in_channels 2 x 4 + 4, CLIP K/V), shards whose condition has parts (text [5, 16],
CLIP [3, 8] and the image latent [4, 3, 4, 6], flat in 'cond', `write_shards(cond_parts=...)`) and a negative prompt.

Checked: the shards carry their parts into the checkpoint's data_info; 2 cycles with teacher CFG 3 (the negative
keeps each sample's image) at TP=2 with sequence parallelism and at CP=2 reproduce one rank to 1e-5 per trace key;
launch/sample.py samples the student and (with CFG) the teacher from the shards' conditions, and blanking the images
changes the samples; malformed parts in index.json are one DataError naming the file; the causal chain
(trajectories, causal init, Self-Forcing) runs on the I2V teacher and refuses Self-Forcing windows past the image.
"""
import json
import os

import numpy as np
import pytest
import torch

from dmd2_mega.data import build_dataset, write_shards
from dmd2_mega.errors import DataError
from dmd2_mega.train.checkpoint import load_payload
from tests.utils import (DMD2_TRACE_KEYS, PRETRAIN_DMD2, REPO, SAMPLE, assert_traces_close, converted_wan_teacher,
                         launch, python, read_trace, run_parallel, world_of_one)

pytestmark = pytest.mark.timeout(600)
INTEGRATION_FIXTURES = ("runs",)  # fixtures that launch processes: their tests are marked integration
I2V = dict(in_channels=12, out_channels=4, image_dim=8, added_kv_proj_dim=24)
PARTS = (("text", (5, 16)), ("clip", (3, 8)), ("image", (4, 3, 4, 6)))


def i2v_data(path: str, n: int = 16, blank: bool = False) -> str:
    """n clips whose image latent is their first frame followed by zero frames (all zeros with `blank`)."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(n, 4, 3, 4, 6, generator=g)
    image = torch.cat([latents[:, :, :1], torch.zeros(n, 4, 2, 4, 6)], dim=2)  # the first frame, then zero frames
    image = torch.zeros_like(image) if blank else image
    cond = torch.cat([torch.randn(n, 5 * 16, generator=g), torch.randn(n, 3 * 8, generator=g), image.flatten(1)], 1)
    write_shards(path, latents, cond=cond, shard_size=8, negative=torch.randn(5, 16, generator=g), cond_parts=PARTS)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("wan_i2v_dmd2")
    teacher, _ = converted_wan_teacher(str(d), **I2V)
    data = i2v_data(str(d / "i2v"))

    def args(out, *more):
        return ["--model-size", teacher, "--teacher-load", teacher, "--data", data, "--micro-batch-size", "2",
                "--global-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2", "--train-iters", "2",
                "--log-interval", "1", "--lr", "1e-3", "--lr-decay-iters", "3", "--dmd2-teacher-guidance-scale", "3",
                "--seed", "3", "--save", out, "--loss-trace", out + ".jsonl", *more]

    layouts = {"tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "cp2": ["--context-parallel-size", "2"]}
    jobs = {"ref": lambda: launch(1, PRETRAIN_DMD2, args(str(d / "ref")), timeout=300),
            **{name: lambda name=name, more=more: launch(2, PRETRAIN_DMD2, args(str(d / name), *more), timeout=300)
               for name, more in layouts.items()}}
    done = run_parallel(jobs)
    for name, res in done.items():
        res.check(name)
    return {**{name: str(d / name) for name in ("ref", *layouts)}, "data": data, "stdout": done["ref"].stdout,
            "teacher": teacher, "blank": i2v_data(str(d / "blank"), blank=True)}


def test_i2v_dmd2_at_tp2_sp_and_cp2_equals_one_rank_with_the_image_in_every_role(runs):
    ref = read_trace(runs["ref"] + ".jsonl")
    assert len(ref) == 2 and all(r["dmd-normaliser"] > 0 for r in ref)
    for name, what in (("tp2", "TP=2 SP"), ("cp2", "CP=2")):
        assert_traces_close(read_trace(runs[name] + ".jsonl"), ref, 1e-5, f"I2V DMD2 {what} vs one rank",
                            keys=DMD2_TRACE_KEYS)
    assert "negative: the negative prompt of" in runs["stdout"]
    with world_of_one() as ps:
        info = load_payload(runs["ref"], ps)["data_info"]
    assert [tuple(p[1]) for p in info["cond_parts"]] == [s for _, s in PARTS]


def test_sample_py_reads_the_image_of_each_condition(runs, tmp_path):
    """launch/sample.py on the I2V student and, with CFG, on the teacher, conditions from --data: the same noise and
    text with the images blanked give other samples."""
    out = {}
    for name, load, more in (("student", runs["ref"], []), ("teacher", runs["teacher"], ["--steps", "3", "--guidance",
                                                                                         "2"])):
        for data in ("data", "blank"):
            python(SAMPLE, ["--load", load, "--data", runs[data], "--num-samples", "4", "--out",
                            str(tmp_path / f"{name}_{data}"), *more]).check(f"{name} on {data}")
            out[name, data] = torch.from_numpy(np.load(tmp_path / f"{name}_{data}" / "samples.npz")["images"])
    for name in ("student", "teacher"):
        a, b = out[name, "data"], out[name, "blank"]
        assert a.shape == (4, 4, 3, 4, 6) and torch.isfinite(a).all()
        assert float((a - b).abs().max()) > 1e-3, f"the {name}'s samples do not depend on the image"


def test_malformed_parts_are_one_error_naming_the_index(tmp_path):
    data = i2v_data(str(tmp_path / "d"), n=4)
    index = json.load(open(os.path.join(data, "index.json")))
    index["cond_parts"][2][1] = [4, 1, 4, 6]  # the parts no longer flatten to cond_shape
    json.dump(index, open(os.path.join(data, "index.json"), "w"))
    with pytest.raises(DataError) as e:
        build_dataset(data, "train")
    assert "index.json" in str(e.value) and "do not describe cond_shape" in str(e.value)


def test_causal_chain_streams_from_the_image_and_refuses_windows_past_it(runs, tmp_path):
    """The causal student on the I2V teacher (the concat form: each chunk its frames of [mask, image latent]): the
    teacher's trajectories keep the condition's parts, the causal init regresses onto them, Self-Forcing trains it;
    rollouts past the data's 3 frames are one ConfigError (a later window has no image to score with)."""
    traj, init = str(tmp_path / "traj"), str(tmp_path / "init")
    python(os.path.join(REPO, "launch", "prepare_trajectories.py"),
           ["--teacher-load", runs["teacher"], "--data", runs["data"], "--out", traj, "--num-samples", "4",
            "--teacher-steps", "4", "--dmd2-denoising-steps", "2", "--guidance", "2"]).check("I2V trajectories")
    assert build_dataset(traj, "train").cond_parts == PARTS
    common = ["--model-size", runs["teacher"], "--teacher-load", runs["teacher"], "--causal", "--causal-chunk-frames",
              "1", "--micro-batch-size", "2", "--global-batch-size", "2", "--dmd2-denoising-steps", "2", "--lr", "1e-4",
              "--train-iters", "1", "--log-interval", "1"]
    launch(1, os.path.join(REPO, "launch", "pretrain_causal_init.py"),
           [*common, "--data", traj, "--save", init]).check("I2V causal init")

    def sf(out, *more):
        return [*common, "--data", runs["data"], "--distill-method", "self-forcing", "--student-load", init,
                "--dmd2-critic-steps-per-rollout", "2", "--dmd2-teacher-guidance-scale", "2",
                "--save", str(tmp_path / out), "--loss-trace", str(tmp_path / out) + ".jsonl", *more]
    launch(1, PRETRAIN_DMD2, sf("sf"), timeout=300).check("self-forcing on I2V")
    (trace,) = read_trace(str(tmp_path / "sf") + ".jsonl")
    assert trace["actor-dmd-loss"] > 0 and trace["critic-loss"] > 0
    res = launch(1, PRETRAIN_DMD2, sf("long", "--self-forcing-rollout-frames", "6"), timeout=300)
    assert res.returncode == 1 and "ConfigError: --self-forcing-rollout-frames 6 past the data's 3 frames" in res.stderr
