"""launch/prepare_trajectories.py (dmd2_mega/prep/trajectories.py): teacher ODE trajectories as a shard set.

Teachers are trained here in-process for 2 iterations: a wan-digits teacher on moving-digits (text embeddings and a
negative prompt) and a debug DiT on digits saved with --timestep-shift 3 (class labels; the shift default).
  1. The stored paths are the teacher's Euler sampler on the stored noise: with shift 1 and the student grid
     [1, .75, .5, .25] on the 8-step Euler grid, latents == flow.euler_sampler(teacher, noise, cond, null, steps=8,
     guidance=2, shift=1) bit for bit (same arithmetic, same batches), and each trajectory point == a float64 Euler
     integration written out here (within fp32 tolerance: the model runs in fp32, the two paths round differently);
     noise == sampling.keyed_noise(seed, rows); trajectory[:, 0] == noise exactly; flow.trajectory_grid merges the
     student points into the teacher grid (and adds them when off it).
  2. ShardDataset opens the output: get_batch gives the x0 and the data's conditions; the negative is the data's;
     the class-conditional case stores labels, and its grid is shifted by the teacher's --timestep-shift.
  3. Resume: a deleted shard is rewritten bit for bit, the other keeps its mtime; another --guidance is a DataError
     naming the shard.
  4. (integration) torchrun with 2 ranks: DP = 2 writes what 1 rank writes; TP = 2 (TP rank 0 writes) the same
     within fp32 tolerance (another reduction order).
"The same files": tensors bit for bit and the header's metadata as a dict (`_assert_same_files`: safetensors writes
its metadata map in a random order per write), index.json and negative.safetensors byte for byte.
  5. Bad flags, a missing teacher, a teacher of another data shape: exit 1 with one line naming the flag.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dmd2_mega import flow
from dmd2_mega.data import ShardDataset, build_dataset
from dmd2_mega.sampling import keyed_noise, load_sampling_model
from dmd2_mega.train.checkpoint import load_payload
from launch import prepare_trajectories, pretrain_flow
from tests.utils import REPO, torchrun, world_of_one

SCRIPT = os.path.join(REPO, "launch", "prepare_trajectories.py")
N, STEPS, G = 6, 8, 2.0
STUDENT = [1.0, 0.75, 0.5, 0.25]


def _pretrain(save: str, *flags: str) -> str:
    with world_of_one():
        rc = pretrain_flow.main([*flags, "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "2",
                                 "--log-interval", "2", "--num-workers", "0", "--save", save])
    assert rc == 0
    return save


def _flags(teacher: str, out: str, *more: str) -> list:
    return ["--teacher-load", teacher, "--data", "moving-digits", "--num-samples", str(N), "--teacher-steps",
            str(STEPS), "--dmd2-student-sigmas", *map(str, STUDENT), "--guidance", str(G), "--shard-size", "4",
            "--out", out, *more]


def _prepare(argv: list) -> int:
    with world_of_one():
        return prepare_trajectories.main(argv)


def _shards(out: str) -> list:
    return [load_file(os.path.join(out, f"shard_{k:05d}.safetensors")) for k in range(2)]


def _assert_same_files(a: str, b: str, names) -> None:
    """Files of two outputs equal: a shard's tensors bit for bit and its header's metadata as a dict (safetensors
    writes the metadata map in a random order each time, so two writes of one shard differ in bytes there), any
    other file byte for byte."""
    for name in names:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if name.startswith("shard_"):
            ta, tb = load_file(pa), load_file(pb)
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
            with safe_open(pa, "pt") as fa, safe_open(pb, "pt") as fb:
                assert fa.metadata() == fb.metadata(), name
        else:
            with open(pa, "rb") as fa, open(pb, "rb") as fb:
                assert fa.read() == fb.read(), name


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return _pretrain(str(tmp_path_factory.mktemp("wan") / "teacher"), "--model-size", "wan-digits", "--data",
                     "moving-digits")


@pytest.fixture(scope="module")
def base(teacher, tmp_path_factory):
    """The reference output: 6 moving-digits rows in shards of 4 (rows 0-3, 4-5), 16 rows per forward."""
    out = str(tmp_path_factory.mktemp("traj") / "out")
    assert _prepare(_flags(teacher, out)) == 0
    return out


def test_trajectory_grid_merges_the_student_points():
    grid, keep = flow.trajectory_grid(8, torch.tensor(STUDENT), 1.0)
    assert grid == [1 - i / 8 for i in range(9)] and keep == [0, 2, 4, 6]
    grid, keep = flow.trajectory_grid(4, flow.student_sigmas(3, None, 1.0), 1.0)  # 2/3 and 1/3 are off the grid
    assert len(grid) == 7 and [grid[i] for i in keep] == flow.student_sigmas(3, None, 1.0).tolist()
    shifted = flow.student_sigmas(4, None, 3.0)  # shifted student points on the shifted 8-step grid
    grid, keep = flow.trajectory_grid(8, shifted, 3.0)
    assert grid == flow.sigma_grid(8, 3.0, torch.float64).tolist() + [0.0] and keep == [0, 2, 4, 6]


def test_trajectories_are_the_teacher_euler_path(teacher, base):
    data = build_dataset("moving-digits")
    shards = _shards(base)
    with world_of_one() as ps:
        payload = load_payload(teacher, ps)
        model, _ = load_sampling_model(payload, payload["data_info"], ps, negative=data.negative)
        model.eval()
        for rows, s in zip(([0, 1, 2, 3], [4, 5]), shards):
            n = len(rows)
            noise, cond = s["noise"], s["cond"]
            assert torch.equal(noise, keyed_noise(0, rows, (1, 4, 16, 16))[0])
            assert torch.equal(cond, data.get_batch(torch.tensor(rows))[1])
            null = model.null_cond(n, ps.device)
            # bit-exact: the same Euler arithmetic on the same batch
            assert torch.equal(s["latents"], flow.euler_sampler(model, noise, cond, null, steps=STEPS, guidance=G,
                                                                shift=1.0))
            assert s["trajectory"].shape == (n, 4, 1, 4, 16, 16) and torch.equal(s["trajectory"][:, 0], noise)
            # float64 Euler with CFG, the fp32 model called on the rounded state: fp32 tolerance
            x, points = noise.double(), {}
            grid = [1 - i / STEPS for i in range(STEPS + 1)]
            with torch.no_grad():
                for sig, nxt in zip(grid, grid[1:]):
                    points[sig] = x
                    sigma = torch.full((n,), sig)
                    v_pos = model(x.float(), sigma, cond).double()
                    v_neg = model(x.float(), sigma, null).double()
                    x = x + (nxt - sig) * (v_neg + G * (v_pos - v_neg))
            for j, sig in enumerate(STUDENT):
                torch.testing.assert_close(s["trajectory"][:, j].double(), points[sig], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(s["latents"].double(), x, rtol=1e-5, atol=1e-5)


def test_output_is_a_shard_set(teacher, base, tmp_path):
    ds, data = ShardDataset(base), build_dataset("moving-digits")
    x, cond = ds.get_batch(torch.arange(N))
    assert len(ds) == N and torch.equal(x, torch.cat([s["latents"] for s in _shards(base)]))
    assert torch.equal(cond, data.get_batch(torch.arange(N))[1]) and torch.equal(ds.negative, data.negative)
    with open(os.path.join(base, "index.json")) as f:
        meta = json.load(f)["trajectory"]
    assert meta == {"sigmas": STUDENT, "teacher": os.path.abspath(teacher), "iteration": 2, "guidance": G,
                    "teacher_steps": STEPS, "timestep_shift": 1.0, "seed": 0, "data": "moving-digits"}
    # class labels, and the grid shifted by the teacher's --timestep-shift
    dit = _pretrain(str(tmp_path / "dit"), "--model-size", "debug", "--data", "digits", "--timestep-shift", "3")
    out = str(tmp_path / "labels")
    assert _prepare(["--teacher-load", dit, "--data", "digits", "--num-samples", "5", "--teacher-steps", "4",
                     "--dmd2-denoising-steps", "2", "--shard-size", "2", "--out", out]) == 0
    ds, digits = ShardDataset(out), build_dataset("digits")
    assert ds.num_classes == 10 and len(ds) == 5
    assert torch.equal(ds.get_batch(torch.arange(5))[1], digits.get_batch(torch.arange(5))[1])
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    assert index["cond"] == "labels" and index["trajectory"]["timestep_shift"] == 3.0
    assert index["trajectory"]["sigmas"] == flow.student_sigmas(2, None, 3.0).tolist()
    assert load_file(os.path.join(out, "shard_00002.safetensors"))["trajectory"].shape == (1, 2, 1, 8, 8)


def test_resume_redoes_only_the_missing_shard(teacher, base, tmp_path, capsys):
    out = str(tmp_path / "out")
    shutil.copytree(base, out)
    first, second = (os.path.join(out, f"shard_{k:05d}.safetensors") for k in range(2))
    os.unlink(first)
    stamp = os.stat(second).st_mtime_ns
    assert _prepare(_flags(teacher, out)) == 0
    printed = capsys.readouterr().out
    assert "wrote shard 0 (4 samples)" in printed and "wrote shard 1" not in printed and "1 kept" in printed
    assert os.stat(second).st_mtime_ns == stamp
    _assert_same_files(base, out, ("shard_00000.safetensors", "index.json"))
    assert _prepare(_flags(teacher, out, "--guidance", "3")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("DataError: ") and "shard_00000.safetensors" in err[0], err
    assert "guidance 2.0 -> 3.0" in err[0]


@pytest.mark.integration
def test_two_ranks_write_what_one_rank_writes(teacher, base, tmp_path):
    out = str(tmp_path / "dp")  # DP = 2: rank r does shard r
    res = torchrun(2, SCRIPT, _flags(teacher, out)).check("prepare_trajectories on 2 ranks")
    assert "rank 0 wrote shard 0" in res.stdout and "rank 1 wrote shard 1" in res.stdout, res.tail()
    _assert_same_files(base, out, ("shard_00000.safetensors", "shard_00001.safetensors", "index.json",
                                   "negative.safetensors"))
    out = str(tmp_path / "tp")  # TP = 2: both ranks run every forward, TP rank 0 writes; another reduction order
    res = torchrun(2, SCRIPT, _flags(teacher, out, "--tensor-model-parallel-size", "2")).check("TP = 2")
    assert "rank 0 wrote shard 1" in res.stdout and "rank 1 wrote" not in res.stdout, res.tail()
    for want, got in zip(_shards(base), _shards(out)):
        assert torch.equal(want["noise"], got["noise"]) and torch.equal(want["cond"], got["cond"])
        for key in ("latents", "trajectory"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


BAD = [  # (a base flag left out, flags added after the base ones (argparse: the last value wins), error, words)
    ("--teacher-load", [], "ConfigError", "--teacher-load is required"),
    ("--data", [], "ConfigError", "--data is required"),
    ("--out", [], "ConfigError", "--out is required"),
    (None, ["--teacher-steps", "0"], "ConfigError", "--teacher-steps 0"),
    (None, ["--guidance", "0.5"], "ConfigError", "--guidance 0.5"),
    (None, ["--shard-size", "0"], "ConfigError", "--shard-size 0"),
    (None, ["--batch-size", "0"], "ConfigError", "--batch-size 0"),
    (None, ["--num-samples", "0"], "ConfigError", "--num-samples 0"),
    (None, ["--seed", "-1"], "ConfigError", "--seed -1"),
    (None, ["--timestep-shift", "0"], "ConfigError", "--timestep-shift 0"),
    (None, ["--dmd2-student-sigmas", "0.5", "0.25"], "GridError", "--dmd2-student-sigmas must start at 1.0"),
    (None, ["--dmd2-denoising-steps", "3", "--dmd2-student-sigmas", "1", "0.5"], "ConfigError",
     "--dmd2-denoising-steps 3"),
    (None, ["--num-samples", "100000"], "ConfigError", "--num-samples 100000"),
    (None, ["--teacher-load", "{tmp}/nowhere"], "CheckpointError", "--teacher-load"),
    (None, ["--out", "{teacher}/out"], "ConfigError", "--out"),
    (None, ["--data", "digits"], "DataError", "--teacher-load"),
]


@pytest.mark.parametrize("drop,extra,kind,says", BAD, ids=[" ".join(b[1][:2]) or f"no {b[0]}" for b in BAD])
def test_bad_flags_are_one_line(teacher, tmp_path, capsys, drop, extra, kind, says):
    base = {"--teacher-load": teacher, "--data": "moving-digits", "--out": str(tmp_path / "out")}
    argv = [v for flag, value in base.items() if flag != drop for v in (flag, value)]
    argv += [f.format(tmp=tmp_path, teacher=teacher) for f in extra]
    assert _prepare(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{kind}: ") and says in err[0], err
    assert not os.path.exists(tmp_path / "out" / "shard_00000.safetensors")
