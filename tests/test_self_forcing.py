"""Self-Forcing DMD through the shared student trainer (issue 30; `methods/self_forcing/method.py`,
launch/pretrain_dmd2.py --distill-method self-forcing): a causal wan-digits student beside a bidirectional critic
and teacher, on moving digits. Checked: the roles' kinds, a finite trace whose DMD and critic losses are logged,
resume mid-run == uninterrupted (bit for bit), TP = 2, CP = 2 and DP = 2 == the world of one (1e-5), rollouts
past the training length (--self-forcing-rollout-frames) at TP = 2 == the world of one, and the method needs
--causal.
"""
import os

import pytest

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.methods.self_forcing.method import SelfForcingMethod
from dmd2_mega.methods.trainer import StudentTrainer
from tests.utils import read_trace, torchrun, wan_digits_teacher, world_of_one

pytestmark = pytest.mark.timeout(600)
INTEGRATION_FIXTURES = ("teacher",)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("actor-dmd-loss", "critic-loss", "actor-grad_norm", "critic-grad_norm")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return wan_digits_teacher(str(tmp_path_factory.mktemp("self_forcing") / "teacher"), 2)


def args(teacher: str, save: str, iters: int, *more) -> list:
    return ["--model-size", "wan-digits", "--data", "moving-digits", "--distill-method", "self-forcing", "--causal",
            "--causal-chunk-frames", "2", "--teacher-load", teacher, "--micro-batch-size", "2",
            "--global-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2", "--dmd2-denoising-steps", "2",
            "--dmd2-teacher-guidance-scale", "2", "--lr", "1e-4", "--lr-decay-iters", "100",
            "--train-iters", str(iters), "--log-interval", "1",
            "--seed", "4", "--save", save, "--save-interval", "2", "--loss-trace", save + ".trace.jsonl", *more]


def test_self_forcing_runs_resumes_exactly_and_tp_cp_dp_match(teacher, tmp_path):
    from launch import pretrain_dmd2
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(teacher, full, 3)), SelfForcingMethod)
        kinds = {name: type(role.model).__name__ for name, role in tr.roles.items()}
        assert kinds == {"student": "CausalWan", "critic": "Wan", "teacher": "Wan"}, kinds
        tr.train()
    trace = read_trace(full + ".trace.jsonl")
    assert [r["iteration"] for r in trace] == [1, 2, 3]
    assert all(set(KEYS) <= set(r) for r in trace)
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, part, 2)) == 0
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, part, 3, "--load", part)) == 0
    resumed = read_trace(part + ".trace.jsonl")
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    for a, b in zip(resumed, trace):
        assert all(a[k] == b[k] for k in KEYS), f"iteration {a['iteration']}: the resume is not exact"
    wide = str(tmp_path / "wide")  # the world of one at DP=2's global batch (2 micro-batches accumulated)
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, wide, 2, "--global-batch-size", "4")) == 0
    for name, layout, want in (("TP=2", ["--tensor-model-parallel-size", "2"], trace),
                               ("CP=2", ["--context-parallel-size", "2"], trace),
                               ("DP=2", ["--global-batch-size", "4"], read_trace(wide + ".trace.jsonl"))):
        run = str(tmp_path / name.replace("=", ""))
        torchrun(2, os.path.join(ROOT, "launch", "pretrain_dmd2.py"), args(teacher, run, 2, *layout)).check(name)
        got = read_trace(run + ".trace.jsonl")
        assert [r["iteration"] for r in got] == [1, 2], name
        for a, b in zip(got, want):
            for k in ("actor-dmd-loss", "critic-loss"):
                assert a[k] == pytest.approx(b[k], rel=1e-5), (name, k, a["iteration"])


def test_rollouts_past_the_training_length_score_windows_and_match_at_tp2(teacher, tmp_path, capsys):
    """--self-forcing-rollout-frames 8 on 4-frame data: 8-frame rollouts, a 4-frame window scored per micro-batch
    (the log says so), a trace that differs from the T-frame one and that TP = 2 reproduces (1e-5); a length
    shorter than the data is a one-line error."""
    from launch import pretrain_dmd2
    long, plain = str(tmp_path / "long"), str(tmp_path / "plain")
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, long, 2, "--self-forcing-rollout-frames", "8")) == 0
    out = capsys.readouterr().out
    assert "rollouts of 8 frames, one window of 4 scored per micro-batch (starts drawn from 3)" in out
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, plain, 1)) == 0
    want = read_trace(long + ".trace.jsonl")
    assert want[0]["actor-dmd-loss"] != read_trace(plain + ".trace.jsonl")[0]["actor-dmd-loss"]
    run = str(tmp_path / "tp2")
    torchrun(2, os.path.join(ROOT, "launch", "pretrain_dmd2.py"),
             args(teacher, run, 2, "--self-forcing-rollout-frames", "8", "--tensor-model-parallel-size", "2")
             ).check("TP=2")
    for a, b in zip(read_trace(run + ".trace.jsonl"), want):
        for k in ("actor-dmd-loss", "critic-loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (k, a["iteration"])
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, str(tmp_path / "short"), 1, "--self-forcing-rollout-frames", "3")) == 1
    err = capsys.readouterr().err
    assert "--self-forcing-rollout-frames 3 is shorter than the data's 4 frames" in err and err.count("\n") == 1


def test_self_forcing_needs_a_causal_student(teacher, tmp_path, capsys):
    from launch import pretrain_dmd2
    argv = [a for a in args(teacher, str(tmp_path / "x"), 1) if a != "--causal"]
    with world_of_one():
        assert pretrain_dmd2.main(argv) == 1
    err = capsys.readouterr().err
    assert "--distill-method self-forcing trains a causal student: give --causal" in err and err.count("\n") == 1
