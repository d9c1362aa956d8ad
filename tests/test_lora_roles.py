"""LoRA roles over one shared frozen base in the student trainer (issue 31 item 2; `models/lora.py`,
`methods/trainer.py` `_adapt`): DMD2 on a wan-digits teacher with --student-lora-rank / --critic-lora-rank.

Checked: the student's and the critic's weights are the teacher's very tensors (one storage, `data_ptr`), only the
adapters train (the optimizers, gradient buffers and EMA see nothing else), the teacher's weights stay bit for bit
what they were, and the run's trace equals, cycle for cycle, the same run with three separate copies of the base
(--no-lora-shared-base, 1e-6) and holds two copies of the base fewer in every phase (the measured resident bytes
of <save>/memory.json); a resume continues it exactly; a target the family lacks and time-slicing a shared
base are one-line errors.
"""
import os
import shutil

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.errors import ConfigError
from dmd2_mega.files.json_file import read_json
from dmd2_mega.methods.dmd2.method import DMD2Method
from dmd2_mega.methods.trainer import StudentTrainer
from dmd2_mega.models.lora import LoRA
from dmd2_mega.pretrained import load_model
from tests.utils import PRETRAIN_DMD2, SAMPLE, read_trace, torchrun, wan_digits_teacher, world_of_one

pytestmark = pytest.mark.timeout(600)
KEYS = ("actor-dmd-loss", "critic-loss", "actor-grad_norm", "critic-grad_norm")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return wan_digits_teacher(str(tmp_path_factory.mktemp("lora_roles") / "teacher"), 4, "--lr", "3e-3")


def args(teacher: str, save: str, iters: int, *more) -> list:
    return ["--model-size", "wan-digits", "--data", "moving-digits", "--teacher-load", teacher,
            "--student-lora-rank", "4", "--critic-lora-rank", "2", "--lora-alpha", "8",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
            "--dmd2-denoising-steps", "2", "--dmd2-teacher-guidance-scale", "2", "--lr", "1e-2",
            "--lr-decay-iters", "100", "--ema-decay", "0.9",
            "--train-iters", str(iters), "--log-interval", "1", "--seed", "3", "--save", save, "--save-interval", "2",
            "--loss-trace", save + ".trace.jsonl", *more]


def base_weights(model) -> dict:
    return {n: p for n, p in model.named_parameters() if ".lora." not in n}


def test_shared_base_is_one_copy_trains_only_adapters_and_equals_separate_copies(teacher, tmp_path, capsys):
    shared, copies = str(tmp_path / "shared"), str(tmp_path / "copies")
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(teacher, shared, 3)), DMD2Method)
        out = capsys.readouterr().out
        lins = [m for m in tr.roles["student"].model.modules() if isinstance(getattr(m, "lora", None), LoRA)]
        count = sum(4 * (m.in_features + m.out_features) for m in lins)
        assert len(lins) == 40 and count == sum(p.numel() for n, p in tr.roles["student"].model.named_parameters()
                                                if ".lora." in n)
        assert (f"> student: LoRA rank 4 alpha 8 on 40 linears (to_q,to_k,to_v,to_out,fc1,fc2; {count:,} adapter "
                f"parameters) over the teacher's weights, shared") in out and "> critic: LoRA rank 2 alpha 8" in out
        t = tr.roles["teacher"].model
        before = {n: p.detach().clone() for n, p in t.named_parameters()}
        for name in ("student", "critic"):
            role = tr.roles[name]
            trunk = dict(role.model.named_modules()).get("trunk", role.model)
            own = base_weights(trunk)
            assert own.keys() == dict(t.named_parameters()).keys()
            assert all(p.data_ptr() == dict(t.named_parameters())[n].data_ptr() for n, p in own.items()), name
            trained = [n for n, p in role.model.named_parameters() if p.requires_grad]
            assert trained and all(".lora." in n or n.startswith("head.") for n in trained), (name, trained)
            assert sum(p.numel() for p in role.grads.params) == sum(
                p.numel() for n, p in role.model.named_parameters() if n in trained)
        assert tr.ema.names and all(".lora." in n for n in tr.ema.names)
        tr.train()
        assert all(torch.equal(p, before[n]) for n, p in t.named_parameters()), "the teacher's weights moved"
        b = [m.B for m in tr.roles["student"].model.modules() if isinstance(m, LoRA)]
        assert any(float(x.abs().max()) > 0 for x in b), "the student's adapters did not train"
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(teacher, copies, 3, "--no-lora-shared-base")), DMD2Method)
        assert "over its own frozen copy of its init" in capsys.readouterr().out
        t = dict(tr.roles["teacher"].model.named_parameters())
        assert all(p.data_ptr() != t[n].data_ptr() for n, p in base_weights(tr.roles["student"].model).items())
        tr.train()
    a, b = read_trace(shared + ".trace.jsonl"), read_trace(copies + ".trace.jsonl")
    assert [r["iteration"] for r in a] == [1, 2, 3]
    for x, y in zip(a, b):
        for k in KEYS:
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-12), (k, x["iteration"])
    # the measured resident bytes count the shared base once: two copies of it fewer, in every phase
    base = sum(p.untyped_storage().nbytes() for p in t.values())  # its weights (each role has its negative buffer)
    one, three = (read_json(os.path.join(d, "memory.json")) for d in (shared, copies))
    assert one["resident_bytes_per_phase"].keys() == {"rollout", "critic", "actor"}
    for phase, nbytes in one["resident_bytes_per_phase"].items():
        assert three["resident_bytes_per_phase"][phase] - nbytes == 2 * base, phase
    assert one["trainable_parameters"] == three["trainable_parameters"] > 0 and one["process_peak_rss_bytes"] > 0


@pytest.fixture(scope="module")
def other_teacher(teacher, tmp_path_factory):
    """The teacher trained 1 cycle more: other base weights."""
    save = str(tmp_path_factory.mktemp("lora_roles") / "other")
    shutil.copytree(teacher, save)
    return wan_digits_teacher(save, 5, "--lr", "3e-3", "--load", save, "--override-opt-param-scheduler")


def test_a_lora_run_resumes_exactly_and_only_over_its_base(teacher, other_teacher, tmp_path, capsys):
    """The checkpoint holds the adapters and where their base is; a resume continues exactly; over other base
    weights it is one line (unless --lora-allow-other-base); the sampler and `pretrained.load_model` read the
    adapters merged into the base: the trained student's output."""
    from launch import pretrain_dmd2
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(teacher, full, 3)), DMD2Method)
        tr.train()
        student = tr.roles["student"].model
        x = torch.randn(2, *tr.shape, generator=torch.Generator().manual_seed(0))
        sigma, cond = torch.tensor([0.3, 0.8]), student.null_cond(2, "cpu")
        with torch.no_grad():
            want = student(x, sigma, cond)
    payload = torch.load(os.path.join(full, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    assert payload["model"] and all(".lora." in k for k in payload["model"]), sorted(payload["model"])[:3]
    assert payload["lora"]["base"] == os.path.abspath(teacher) and payload["lora"]["scale"] == 2.0
    merged = load_model(full, ema=False)
    with torch.no_grad():
        got = merged(x, sigma, cond)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    from launch import convert_checkpoint
    out = str(tmp_path / "merged")
    convert_checkpoint.main(convert_checkpoint.parse_args(["--load", full, "--merge-lora", "--save", out]))
    with torch.no_grad():
        again = load_model(out, ema=False)(x, sigma, cond)
    assert torch.equal(again, got)  # the merged checkpoint holds what the merge on read gives
    with pytest.raises(ConfigError, match="holds full weights, not LoRA adapters: nothing to merge"):
        convert_checkpoint.main(convert_checkpoint.parse_args(["--load", out, "--merge-lora", "--save",
                                                               str(tmp_path / "again")]))
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, part, 2)) == 0
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, part, 3, "--load", part)) == 0
    want, got = read_trace(full + ".trace.jsonl"), read_trace(part + ".trace.jsonl")
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        assert all(a[k] == b[k] for k in KEYS), f"iteration {a['iteration']}: the resume is not exact"
    capsys.readouterr()
    with world_of_one():
        assert pretrain_dmd2.main(args(other_teacher, str(tmp_path / "x"), 4, "--load", part)) == 1
    err = capsys.readouterr().err
    assert "holds LoRA adapters trained over the base" in err and "--lora-allow-other-base" in err, err
    assert err.count("\n") == 1
    with world_of_one():
        assert pretrain_dmd2.main(args(other_teacher, str(tmp_path / "y"), 4, "--load", part,
                                       "--lora-allow-other-base")) == 0
    with world_of_one():  # full weights into a LoRA run, and adapters into a full-weight run
        assert pretrain_dmd2.main(args(teacher, str(tmp_path / "z"), 4, "--load", part, "--student-lora-rank",
                                       "0")) == 1
    err = capsys.readouterr().err
    assert "holds LoRA adapters of rank 4, this run's student is full weights: give --student-lora-rank 4" in err


@pytest.mark.integration
def test_lora_roles_at_tp2_and_their_checkpoint_read_at_another_tp(teacher, tmp_path):
    """A 2-cycle LoRA run at TP = 2 == the world of one (1e-5); the TP = 1 checkpoint sampled at TP = 2 (adapters
    and base resharded, the base's fingerprint summed over both ranks) == sampled at TP = 1."""
    import numpy as np
    from launch import pretrain_dmd2, sample as sample_script
    ref, tp2 = str(tmp_path / "ref"), str(tmp_path / "tp2")
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, ref, 2)) == 0
    torchrun(2, PRETRAIN_DMD2, args(teacher, tp2, 2, "--tensor-model-parallel-size", "2")).check("TP=2")
    for a, b in zip(read_trace(tp2 + ".trace.jsonl"), read_trace(ref + ".trace.jsonl")):
        for k in ("actor-dmd-loss", "critic-loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (k, a["iteration"])
    one, two = str(tmp_path / "s1"), str(tmp_path / "s2")
    with world_of_one():
        assert sample_script.main(["--load", ref, "--num-samples", "4", "--num-media", "0", "--out", one]) == 0
    torchrun(2, SAMPLE, ["--load", ref, "--num-samples", "4", "--num-media", "0", "--out", two,
                         "--tensor-model-parallel-size", "2"]).check("sample at TP=2")
    x1, x2 = (np.load(os.path.join(d, "samples.npz"))["images"] for d in (one, two))
    assert x1.shape == x2.shape and float(np.abs(x1 - x2).max()) <= 1e-4 * float(np.abs(x1).max())


def test_a_lora_critic_keeps_its_gan_head_trainable(teacher, tmp_path):
    """--dmd2-gan: the critic is the GAN critic around its trunk; the trunk gets the adapters over the teacher's
    weights, the head stays trainable, and a cycle runs."""
    with world_of_one():
        tr = StudentTrainer(parse_dmd2_args(args(teacher, str(tmp_path / "gan"), 1, "--dmd2-gan")), DMD2Method)
        critic = tr.roles["critic"].model
        trained = {n for n, p in critic.named_parameters() if p.requires_grad}
        assert {n for n in trained if not n.startswith("head.")} == {n for n in trained if ".lora." in n}
        assert any(n.startswith("head.") for n in trained) and any(".lora." in n for n in trained)
        t = dict(tr.roles["teacher"].model.named_parameters())
        assert all(p.data_ptr() == t[n[len("trunk."):]].data_ptr() for n, p in critic.named_parameters()
                   if n.startswith("trunk.") and ".lora." not in n)
        tr.train()


@pytest.mark.parametrize("more, message", [
    (["--lora-target-modules", "to_q,qkv"], "--lora-target-modules: Wan has no linear named qkv (its LoRA targets: "
                                            "to_q,to_k,to_v,to_out,fc1,fc2)"),
    (["--offload-inactive"], "--offload-roles / --offload-inactive: the LoRA roles student, critic share the "
                             "teacher's weights"),
    (["--student-lora-rank", "-1"], "--student-lora-rank must be >= 0"),
])
def test_lora_mistakes_are_one_line_errors(teacher, tmp_path, capsys, more, message):
    from launch import pretrain_dmd2
    with world_of_one():
        assert pretrain_dmd2.main(args(teacher, str(tmp_path / "x"), 1, *more)) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
