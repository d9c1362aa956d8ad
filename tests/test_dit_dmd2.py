"""DMD2 from an imported class-conditional teacher: a tiny official-layout SiT (learned sigma, 1 x 8 x 8, 10
classes: the digits data's shape) converted at TP=2 (`pretrained.import_dit`), distilled with the GAN head
and EMA at TP=2 and at TP=1 (its checkpoint resharded on load): the traces are equal, every role was built through
the SiT adapter, and the student's first rollout is the teacher's few-step sample (the student starts as an exact
copy of the teacher in its own parameterisation). A DDPM-eps teacher (the same network read as DiT's) runs too:
its rollout starts at sigma = 1, above DDPM's last level, and stays finite. Then launch/eval_fid.py on the TP=2
student (the acceptance path of the image-teacher issue).
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dmd2_mega.pretrained import import_dit, load_model
from dmd2_mega.sampling import few_step_sample
from tests.test_dit_import import HEADS, official_state
from tests.test_fid import (_fid_scipy, _printed_fid, _regenerated_stats, _run_in_process, write_net_file,
                            write_ref_file)
from tests.utils import DMD2_TRACE_KEYS, PRETRAIN_DMD2, assert_traces_close, launch, read_trace

INTEGRATION_FIXTURES = ("runs",)  # fixtures that launch processes: their tests are marked integration
GAN_KEYS = DMD2_TRACE_KEYS + ("gan-disc-loss", "gan-logit-gap", "actor-gan-loss")


def _args(teacher: str, d, name: str) -> list:
    return ["--model-size", teacher, "--teacher-load", teacher, "--data", "digits", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--dmd2-critic-steps-per-rollout", "2", "--dmd2-denoising-steps", "2",
            "--log-interval", "1", "--lr", "1e-3", "--dmd2-teacher-guidance-scale", "1.5", "--seed", "3",
            "--dmd2-gan", "--dmd2-gan-disc-weight", "1", "--dmd2-gan-gen-weight", "1", "--ema-decay", "0.5",
            "--train-iters", "3", "--save", str(d / name), "--save-interval", "3",
            "--loss-trace", str(d / f"{name}.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dit_dmd2")
    torch.save(official_state(channels=1, seed=4), d / "sit.pt")
    for kind in ("sit", "vp-eps"):  # in process: test_dit_import runs the CLI
        import_dit(str(d / "sit.pt"), str(d / kind), 2, kind, HEADS, log=lambda *_: None)
    jobs = {"tp2": (2, _args(str(d / "sit"), d, "tp2") + ["--tensor-model-parallel-size", "2"]),
            "tp1": (1, _args(str(d / "sit"), d, "tp1")), "eps": (1, _args(str(d / "vp-eps"), d, "eps"))}
    with ThreadPoolExecutor(2) as pool:  # two runs at a time: each rank is one thread (OMP_NUM_THREADS=1)
        futs = {k: pool.submit(launch, n, PRETRAIN_DMD2, args, timeout=300) for k, (n, args) in jobs.items()}
        res = {k: f.result() for k, f in futs.items()}
    for name, r in res.items():
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    return d, res


def test_sit_teacher_distils_at_tp2_as_at_tp1(runs):
    """Also the GAN head and the EMA at TP=2 (test_dmd2_gan_ema_runs covers them at DP=2, offloaded, resumed)."""
    d, res = runs
    assert "TP=2 DP=1" in res["tp2"].stdout
    assert "conv head (weight decay 0.01, clip 10) on block 0's token grid" in res["tp2"].stdout
    tp1, tp2 = read_trace(str(d / "tp1.jsonl")), read_trace(str(d / "tp2.jsonl"))
    assert [r["iteration"] for r in tp1] == [1, 2, 3]
    assert min(r["actor-gan-loss"] for r in tp1) > 0.1 and max(abs(r["gan-logit-gap"]) for r in tp1) > 1e-4
    assert_traces_close(tp1, tp2, 1e-5, "SiT teacher TP=2 vs TP=1", keys=GAN_KEYS)
    ema1, ema2 = load_model(str(d / "tp1")), load_model(str(d / "tp2"))  # the EMA weights, TP=2 joined to TP=1
    raw = load_model(str(d / "tp1"), ema=False)
    for (n, a), b, r in zip(ema1.named_parameters(), ema2.parameters(), raw.parameters()):
        # 1e-5: Adam (lr 1e-3) normalises the attention key bias's gradient, zero up to rounding, to a full step,
        # whose sign differs between TP sizes: both the raw and the EMA weights differ there by ~2e-6
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=n)
    assert any(not torch.equal(a, r) for a, r in zip(ema1.parameters(), raw.parameters()))


def test_the_student_starts_as_the_teacher_through_its_adapter(runs):
    """The student's checkpoint records the spec (sit) and the weights moved by 3 actor steps only; the teacher
    itself, loaded through load_model, is a SiT-adapted model whose velocity is minus its network's."""
    d, _ = runs
    teacher = load_model(str(d / "sit"))
    student = load_model(str(d / "tp1"), ema=False)
    assert teacher.spec.parameterization == student.spec.parameterization == "sit"
    x, s, y = torch.randn(2, 1, 8, 8), torch.tensor([1.0, 0.3]), torch.tensor([2, 10])
    with torch.no_grad():
        torch.testing.assert_close(teacher(x, s, y), -teacher.network(x, 1 - s, y), rtol=0, atol=0)
        moved = max((a - b).abs().max().item() for a, b in zip(student.parameters(), teacher.parameters()))
    assert 0 < moved < 0.1  # trained from the teacher's weights (lr 1e-3, 3 steps), not from scratch
    with torch.no_grad():  # a few-step sample of the teacher through the adapter is finite at sigma = 1
        out = few_step_sample(teacher, torch.randn(2, 2, 1, 8, 8), y, torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out).all()


def test_ddpm_eps_teacher_runs_from_pure_noise(runs):
    d, _ = runs
    trace = read_trace(str(d / "eps.jsonl"))
    assert len(trace) == 3
    for rec in trace:
        assert all(torch.isfinite(torch.tensor(rec[k])) for k in GAN_KEYS), rec
    assert load_model(str(d / "eps")).spec.parameterization == "vp-eps"


def test_eval_fid_on_the_tp2_student(runs, tmp_path, capsys):
    """The acceptance path: the student distilled from the SiT teacher at TP=2, then launch/eval_fid.py against
    synthetic reference statistics with a tiny Inception-like network: the printed FID is the scipy FID of the
    student's (EMA) samples' features, regenerated here from the library's parts."""
    d, _ = runs
    n, net_file, ref_file = 30, write_net_file(tmp_path), write_ref_file(tmp_path)
    out = _run_in_process(capsys, ["--load", str(d / "tp2"), "--ref-stats", ref_file, "--inception-weights",
                                   net_file, "--num-samples", str(n), "--batch-size", "8", "--seed", "5"])
    assert "student 2 steps, EMA weights" in out, out
    mu, sigma = _regenerated_stats(str(d / "tp2"), net_file, n, 5, None, 1.0)
    with np.load(ref_file) as ref:
        want = _fid_scipy(mu, sigma, ref["mu"], ref["sigma"])
    # printed to 4 decimals: within half its last digit, plus round-off
    assert abs(_printed_fid(out) - want) <= 5e-5 + 1e-6 * max(1.0, want), (out, want)
