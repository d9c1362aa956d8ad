"""The causal student's initialisation from teacher trajectories (issue 29 item 4, the training half):
`methods/causal_init/method.py` through the shared student trainer, `data/trajectories.py`,
`launch/pretrain_causal_init.py`.

  a. Each chunk's frames come from its own path state (against a loop written here), and the loss is the x0
     regression written out here in float64 on the same draws (a chunk at the context level reads the clean x0).
  b. Through the shared trainer on a trajectory set (written here: random paths of the moving-digits shape): the
     student starts at the teacher's weights and learns (the loss falls), a resume from cycle 2 continues the
     uninterrupted trace exactly, and TP = 2, CP = 2 and DP = 2 (torchrun) give the world of one's trace (fp32,
     1e-5). Its checkpoint streams with launch/sample.py --stream past the training length, and the streamed first
     chunk equals sample.py's non-streamed few-step sample of the same seed.
  c. Bad input: no --causal, paths stored at another grid, a shard set without paths: one-line errors.
"""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dmd2_mega import flow
from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.data.trajectories import TrajectoryDataset
from dmd2_mega.errors import DataError
from dmd2_mega.methods.causal_init.method import CausalInitMethod, path_states
from dmd2_mega.methods.trainer import StudentTrainer
from dmd2_mega.models.causal import CausalLayout
from tests.utils import read_trace, torchrun, world_of_one

pytestmark = pytest.mark.timeout(600)
INTEGRATION_FIXTURES = ("teacher",)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (1, 4, 16, 16)  # moving digits: [C, T, H, W]
GRID = flow.student_sigmas(4, None, 1.0).tolist()


def write_paths(root: str, n: int = 24, sigmas=GRID, with_paths: bool = True, seed: int = 0) -> str:
    """A trajectory set of n random paths (two shards) with moving-digits' shapes and the prompts' width."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(root)
    shards = []
    for k, m in enumerate((n // 2, n - n // 2)):
        t = {"latents": torch.randn(m, *SHAPE, generator=g), "cond": torch.randn(m, 4, 16, generator=g),
             "noise": torch.randn(m, *SHAPE, generator=g)}
        if with_paths:
            t["trajectory"] = torch.randn(m, len(sigmas), *SHAPE, generator=g)
        save_file(t, os.path.join(root, f"shard_{k:05d}.safetensors"))
        shards.append({"file": f"shard_{k:05d}.safetensors", "num_samples": m})
    index = {"shards": shards, "latent_shape": list(SHAPE), "cond": "embedding", "cond_shape": [4, 16],
             **({"trajectory": {"sigmas": list(sigmas)}} if with_paths else {})}
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump(index, f)
    return root


# ---- a. the maths -------------------------------------------------------------------------------------------

def test_each_chunk_reads_its_own_path_state():
    paths = torch.randn(3, 5, 2, 7, 2, 3)  # [B, N + 1, C, F, H, W]
    layout = CausalLayout(3)
    chunks = layout.chunks(7)
    assert chunks == [(0, 1), (1, 4), (4, 7)]
    k = torch.tensor([[0, 3, 1], [2, 2, 0], [4, 1, 3]])
    got = path_states(paths, k, torch.tensor(layout.frame_chunks(7)))
    for b in range(3):
        for c, (s, e) in enumerate(chunks):
            assert torch.equal(got[b, :, s:e], paths[b, int(k[b, c]), :, s:e])


class Linear(torch.nn.Module):
    """A stand-in student: v = a x + sigma-per-frame (so the loss's per-chunk levels show)."""

    def __init__(self, chunks):
        super().__init__()
        self.a, self.chunks = torch.nn.Parameter(torch.tensor(0.3)), chunks

    def forward(self, x, sigma, cond):
        per_frame = torch.cat([sigma[:, i:i + 1].expand(-1, e - s) for i, (s, e) in enumerate(self.chunks)], 1)
        return self.a * x + per_frame[:, None, :, None, None]


def test_the_loss_is_the_x0_regression_in_float64():
    cfg = parse_dmd2_args(["--model-size", "wan-digits", "--causal", "--causal-chunk-frames", "3",
                           "--teacher-load", "unused", "--data", "unused"])
    method = CausalInitMethod(cfg, (1, 7, 4, 4), torch.device("cpu"))
    assert method.chunks == [(0, 1), (1, 4), (4, 7)]
    student = type("Role", (), {"model": Linear(method.chunks)})()
    paths = torch.randn(2, 5, 1, 7, 4, 4, generator=torch.Generator().manual_seed(1))
    got = method.loss(student, paths, None, torch.Generator().manual_seed(9))
    k = torch.randint(5, (2, 3), generator=torch.Generator().manual_seed(9))  # the same draws; 4: the context
    assert (k == 4).any() and (k < 4).any(), "the draws should show both kinds of level"
    s = torch.cat([method.student_sigmas.double(), torch.zeros(1, dtype=torch.float64)])[k]
    p = paths.double()  # p[:, 4] is x0: the clean context (--causal-context-noise 0)
    want = 0.0
    for b in range(2):
        for c, (lo, hi) in enumerate(method.chunks):
            x = p[b, int(k[b, c]), :, lo:hi]
            x0 = x - s[b, c] * (0.3 * x + s[b, c])
            want += float(((x0 - p[b, -1, :, lo:hi]) ** 2).sum())
    assert float(got.detach()) == pytest.approx(want / paths[:, 0].numel(), rel=1e-6)


# ---- b. through the shared trainer --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from launch import pretrain_flow
    d = tmp_path_factory.mktemp("causal_init")
    save = str(d / "teacher")
    with world_of_one():
        assert pretrain_flow.main(["--model-size", "wan-digits", "--data", "moving-digits", "--micro-batch-size", "4",
                                   "--global-batch-size", "4", "--train-iters", "2", "--save", save]) == 0
    return save, write_paths(str(d / "paths"))


def args(teacher: str, paths: str, save: str, iters: int, *more) -> list:
    return ["--model-size", "wan-digits", "--causal", "--causal-chunk-frames", "2", "--teacher-load", teacher,
            "--data", paths, "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
            "--lr-decay-iters", "100", "--train-iters", str(iters), "--log-interval", "1", "--seed", "3",
            "--num-workers", "0", "--save", save, "--save-interval", "2", "--loss-trace", save + ".trace.jsonl",
            *more]


def test_init_learns_resumes_exactly_and_tp_cp_dp_match(teacher, tmp_path):
    from launch import pretrain_causal_init
    ckpt, paths = teacher
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(ckpt, paths, full, 6)), CausalInitMethod)
        assert set(tr.roles) == {"student"} and type(tr.roles["student"].model).__name__ == "CausalWan"
        tr.train()
    trace = read_trace(full + ".trace.jsonl")
    assert [r["iteration"] for r in trace] == list(range(1, 7))
    assert trace[-1]["init-loss"] < trace[0]["init-loss"]
    with world_of_one():
        assert pretrain_causal_init.main(args(ckpt, paths, part, 2)) == 0
    with world_of_one():
        assert pretrain_causal_init.main(args(ckpt, paths, part, 6, "--load", part)) == 0
    resumed = read_trace(part + ".trace.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(1, 7))
    for a, b in zip(resumed, trace):
        assert a["init-loss"] == b["init-loss"], f"iteration {a['iteration']}: resume is not exact"
    # the init checkpoint is a few-step student: sample.py streams it past the training length, and its streamed
    # first chunk equals the non-streamed sample of the same seed (the first chunk sees only itself either way)
    from launch import sample
    common = ["--load", full, "--data", "moving-digits", "--num-samples", "3", "--seed", "2", "--num-media", "0"]
    with world_of_one():
        assert sample.main([*common, "--stream", "--num-frames", "8", "--out", str(tmp_path / "long")]) == 0
        assert sample.main([*common, "--stream", "--out", str(tmp_path / "s")]) == 0
        assert sample.main([*common, "--out", str(tmp_path / "p")]) == 0
    with np.load(tmp_path / "long" / "samples.npz") as npz:
        assert npz["images"].shape == (3, *SHAPE[:1], 8, *SHAPE[2:])
    with np.load(tmp_path / "s" / "samples.npz") as s, np.load(tmp_path / "p" / "samples.npz") as p:
        np.testing.assert_allclose(s["images"][:, :, :2], p["images"][:, :, :2], rtol=0, atol=1e-6)
        assert np.abs(s["images"][:, :, 2:] - p["images"][:, :, 2:]).max() > 1e-4
    for name, layout in (("TP=2", ["--tensor-model-parallel-size", "2"]), ("CP=2", ["--context-parallel-size", "2"]),
                         ("DP=2", [])):
        run = str(tmp_path / name.replace("=", ""))
        torchrun(2, os.path.join(ROOT, "launch", "pretrain_causal_init.py"),
                 args(ckpt, paths, run, 6, *layout)).check(name)
        got = read_trace(run + ".trace.jsonl")
        assert [r["iteration"] for r in got] == list(range(1, 7)), name
        for a, b in zip(got, trace):
            assert a["init-loss"] == pytest.approx(b["init-loss"], rel=1e-5), (name, a["iteration"])


# ---- c. bad input -------------------------------------------------------------------------------------------

def test_bad_input_is_one_line(teacher, tmp_path, capsys):
    from launch import pretrain_causal_init
    ckpt, paths = teacher
    plain = write_paths(str(tmp_path / "plain"), with_paths=False)
    bad = [([a for a in args(ckpt, paths, str(tmp_path / "a"), 1) if a != "--causal"], "give --causal"),
           (args(ckpt, paths, str(tmp_path / "b"), 1, "--dmd2-denoising-steps", "3"),
            "holds paths at the student sigmas [1.0, 0.75, 0.5, 0.25]"),
           (args(ckpt, plain, str(tmp_path / "c"), 1), "holds no teacher trajectories")]
    for argv, message in bad:
        with world_of_one():
            assert pretrain_causal_init.main(argv) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(DataError, match="holds no teacher trajectories"):
        TrajectoryDataset(plain)
