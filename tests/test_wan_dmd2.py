"""DMD2 on the Wan family, end to end on CPU: a teacher converted from a tiny random diffusers
`WanTransformer3DModel` (the wan-debug sizes), 5-D latents [4, 3, 4, 6] with per-token text embeddings [5, 16]
and a negative-prompt embedding stored with the data.

  a. TP=2 and DP=2 reproduce TP=1 / DP=1 (same global batch, noise keyed by the global micro index): the
     --loss-trace of 2 cycles with the GAN head and EMA on agrees to 1e-5 per key;
  b. 2 cycles + resume + 1 equals 3 straight (exact resume on 5-D latents);
  c. the exported student (--to-diffusers) loaded by diffusers, run as a WanPipeline-style loop with the exported
     FlowMatchEulerDiscreteScheduler (stochastic sampling: predict x0, re-noise to the next sigma), equals our
     few-step sampler on the same noise; `launch/sample.py` samples the converted teacher and the student;
  d. CFG's negative branch is the data's negative-prompt embedding: the same run with it removed scores differently,
     and the start-up line says which of the two it uses.
"""
import json
import os
import shutil
import warnings

from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
import pytest
import torch

from dmd2_mega.data import write_shards
from dmd2_mega.pretrained import load_model
from dmd2_mega.sampling import few_step_sample
from tests.utils import (DMD2_TRACE_KEYS, PRETRAIN_DMD2, REPO, assert_traces_close, converted_wan_teacher, launch,
                         python, read_trace, run_parallel, world_of_one)

pytestmark = pytest.mark.timeout(600)
INTEGRATION_FIXTURES = ("setup", "runs",)  # fixtures that launch processes: their tests are marked integration
CONVERT = os.path.join(REPO, "launch", "convert_checkpoint.py")
SAMPLE = os.path.join(REPO, "launch", "sample.py")
GAN_KEYS = DMD2_TRACE_KEYS + ("gan-disc-loss", "actor-gan-loss")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(converted teacher at TP=1, data dir, the same data without its negative prompt)."""
    d = tmp_path_factory.mktemp("wan_dmd2")
    teacher, data = converted_wan_teacher(str(d))
    g = torch.Generator().manual_seed(0)  # the same latents and text, without the negative prompt
    lat, cond = torch.randn(32, 4, 3, 4, 6, generator=g), torch.randn(32, 5, 16, generator=g)
    write_shards(str(d / "data_noneg"), lat, cond=cond, shard_size=8)
    return teacher, data, str(d / "data_noneg")


def args(teacher, data, out, iters=2, extra=()):
    return ["--model-size", teacher, "--teacher-load", teacher, "--data", data, "--micro-batch-size", "2",
            "--global-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2", "--train-iters", str(iters),
            "--log-interval", "1", "--lr", "1e-3", "--lr-decay-iters", "3", "--dmd2-teacher-guidance-scale", "3",
            "--seed", "3",
            "--dmd2-gan", "--ema-decay", "0.9", "--save", out, "--loss-trace", out + ".jsonl", *extra]


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    teacher, data, _ = setup
    d = str(tmp_path_factory.mktemp("wan_runs"))
    jobs = {name: (lambda n=n, name=name, extra=extra: launch(n, PRETRAIN_DMD2, args(teacher, data, f"{d}/{name}",
                                                                                   extra=extra), timeout=300))
            for name, n, extra in (("ref", 1, ()), ("tp2", 2, ("--tensor-model-parallel-size", "2")), ("dp2", 2, ()))}
    done = run_parallel(jobs)
    for name, res in done.items():
        res.check(name)
    return {name: f"{d}/{name}" for name in jobs} | {"ref-stdout": done["ref"].stdout}


def test_tp2_and_dp2_equal_tp1(runs):
    ref = read_trace(runs["ref"] + ".jsonl")
    assert len(ref) == 2 and all(r["dmd-normaliser"] > 0 for r in ref)
    assert_traces_close(read_trace(runs["tp2"] + ".jsonl"), ref, 1e-5, "Wan DMD2 TP=2 vs TP=1", keys=GAN_KEYS)
    assert_traces_close(read_trace(runs["dp2"] + ".jsonl"), ref, 1e-5, "Wan DMD2 DP=2 vs DP=1", keys=GAN_KEYS)


@pytest.mark.integration
def test_resume_is_exact(setup, runs, tmp_path):
    teacher, data, _ = setup
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    python(PRETRAIN_DMD2, args(teacher, data, straight, iters=3), timeout=300).check("straight")
    shutil.copytree(runs["ref"], split)
    shutil.copytree(runs["ref"] + "_critic", split + "_critic")
    python(PRETRAIN_DMD2, args(teacher, data, split, iters=3, extra=("--load", split)), timeout=300).check("resume")
    assert_traces_close(read_trace(split + ".jsonl"), read_trace(straight + ".jsonl")[2:], 1e-7,
                        "Wan DMD2 2 + resume + 1 vs 3 straight", keys=GAN_KEYS)


@pytest.mark.integration
def test_export_runs_in_a_diffusers_few_step_loop(setup, runs, tmp_path):
    teacher, data, _ = setup
    out = tmp_path / "export"
    python(CONVERT, ["--load", runs["tp2"], "--to-diffusers", out]).check("export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = WanTransformer3DModel.from_pretrained(out, subfolder="transformer").eval()
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    sigmas = json.load(open(out / "scheduler" / "scheduler_config.json"))["_dmd2_student_sigmas"]
    assert len(sigmas) == 4 and scheduler.config.stochastic_sampling
    cond, shape = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(5)), (2, 4, 3, 4, 6)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(shape, generator=g)
    scheduler.set_timesteps(sigmas=sigmas)
    with torch.no_grad():
        for t in scheduler.timesteps:  # WanPipeline's denoising loop, guidance 1 (a student needs no CFG)
            v = transformer(x, t.expand(shape[0]), cond).sample
            x = scheduler.step(v, t, x, generator=g).prev_sample
    g = torch.Generator().manual_seed(9)
    noise = torch.stack([torch.randn(shape, generator=g) for _ in sigmas])
    with world_of_one():
        ours = few_step_sample(load_model(runs["tp2"]), noise, cond, torch.tensor(sigmas))
    assert float((x - ours).abs().max()) <= 1e-5 * float(ours.abs().max())
    for load, extra in ((teacher, ["--data", data, "--steps", "3", "--guidance", "2"]), (runs["tp2"], [])):
        r = python(SAMPLE, ["--load", load, "--num-samples", "3", "--out", tmp_path / os.path.basename(load)] + extra)
        assert "samples [4, 3, 4, 6]" in r.check("sample").stdout


@pytest.mark.integration
def test_cfg_negative_branch_is_the_datas_negative_prompt(setup, runs, tmp_path):
    teacher, _, noneg = setup
    run = str(tmp_path / "noneg")
    printed = python(PRETRAIN_DMD2, args(teacher, noneg, run, iters=1), timeout=300).check("no negative").stdout
    data = os.path.dirname(runs["ref-stdout"].split("(negative: the negative prompt of ")[1].split(")")[0])
    assert data == setup[1], runs["ref-stdout"]  # the start-up line names the negative it uses, and why
    assert (f"teacher guidance 3.0 (negative: the zero embedding ({noneg} holds no negative.safetensors; "
            f"launch/prepare_data.py writes one from --negative-prompt))") in printed, printed
    ref, other = read_trace(runs["ref"] + ".jsonl")[0], read_trace(run + ".jsonl")[0]
    assert ref["critic-loss"] == other["critic-loss"]  # the critic never sees the negative branch
    assert abs(ref["dmd-fake-real-gap"] - other["dmd-fake-real-gap"]) > 1e-4 * abs(ref["dmd-fake-real-gap"])
