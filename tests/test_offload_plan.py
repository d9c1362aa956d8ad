"""The offload default of the DMD2 trainer (GPU issue 12, item 4): the flags win (--offload-roles a subset,
--offload-inactive every role, --no-offload-inactive none; the first excludes the other two and names only the
method's roles); on a CPU nothing sleeps; on CUDA the memory plan, over the method's own phase table, picks the
roles that must sleep for every phase to fit --gpu-memory-gb (none when all fit, all three with a warning when
nothing fits). CUDA is stood in for by the trainer's ParallelState device: the choice reads only the plan and the
budget."""
import dataclasses

import pytest
import torch

from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.methods.dmd2.phases import PHASES, ROLES
from dmd2_mega.errors import ConfigError
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)


def trainer(teacher, *extra):
    return DMD2Trainer(parse_dmd2_args(["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "2",
                                        "--train-iters", "1", *extra]))


def with_budget(tr, gib):
    tr.ps = dataclasses.replace(tr.ps, device=torch.device("cuda"))
    tr.cfg = dataclasses.replace(tr.cfg, dmd2=dataclasses.replace(tr.cfg.dmd2, gpu_memory_gb=gib))
    return tr._offload_plan()


def test_offload_default(debug_teacher, capsys):
    with world_of_one():
        tr = trainer(debug_teacher)
        assert tr.offload == frozenset() and all(r.sleeper is None for r in tr.roles.values())
        assert "offload none (on a CPU there is no device memory to save)" in capsys.readouterr().out
        assert trainer(debug_teacher, "--offload-inactive").offload == ROLES
        assert trainer(debug_teacher, "--no-offload-inactive").offload == frozenset()
        roles, note = with_budget(tr, 1000.0)
        assert roles == frozenset() and "of 1000 GiB" in note
        roles, note = with_budget(tr, 1e-6)
        assert roles == ROLES and "OVER the budget" in note
        # in between: exactly the planner's choice for that budget
        info = tr.info
        plan = mp.plan_cycle(mp.model_shape("debug", info["in_channels"], info["image_size"]), PHASES, tp=1, dp=1,
                             micro=2,
                             steps=tr.cfg.dmd2.critic_steps_per_rollout, denoise=len(tr.method.student_sigmas),
                             bf16=False, guidance=tr.cfg.dmd2.teacher_guidance_scale)
        budget = max(mp.phase_bytes(plan, frozenset(["student", "critic"])).values())
        roles, _ = with_budget(tr, budget / mp.PLAN_HEADROOM / 2**30)
        assert roles == mp.choose_offload(plan, budget)[0] == frozenset(["student", "critic"])


@pytest.mark.parametrize("gib", ["0", "nan", "inf"])
def test_gpu_memory_must_be_positive(gib):
    with pytest.raises(ConfigError, match="--gpu-memory-gb must be a finite number > 0"):
        parse_dmd2_args(["--teacher-load", "x", "--gpu-memory-gb", gib])


def test_offload_roles_sleep_only_those(debug_teacher, capsys):
    with world_of_one():
        tr = trainer(debug_teacher, "--offload-roles", "critic,teacher")
        assert tr.offload == frozenset(["critic", "teacher"])
        assert {n for n, r in tr.roles.items() if r.sleeper is not None} == {"critic", "teacher"}
        assert "offload critic+teacher (--offload-roles critic,teacher)" in capsys.readouterr().out
        assert with_budget(tr, 1e-6)[0] == frozenset(["critic", "teacher"])  # the flag wins over the plan on CUDA


@pytest.mark.parametrize("flags,message", [
    (["--offload-roles", "critic", "--offload-inactive"],
     "--offload-roles critic and --offload-inactive both say which roles sleep; give one of them"),
    (["--offload-roles", "critic", "--no-offload-inactive"],
     "--offload-roles critic and --no-offload-inactive both say which roles sleep"),
    (["--offload-roles", "critic,,teacher"], "--offload-roles takes distinct role names separated by commas"),
    (["--offload-roles", "critic,critic"], "--offload-roles takes distinct role names"),
], ids=["with-offload-inactive", "with-no-offload-inactive", "empty-name", "repeated"])
def test_offload_roles_rejected_at_parse(flags, message):
    with pytest.raises(ConfigError) as e:
        parse_dmd2_args(["--teacher-load", "x", *flags])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_offload_roles_names_the_methods_roles(tmp_path, capsys):
    """A name that is not one of the method's roles: one line naming the flag and the roles, before the teacher is
    read (the --teacher-load here does not exist)."""
    from launch import pretrain_dmd2
    with world_of_one():
        rc = pretrain_dmd2.main(["--model-size", "debug", "--teacher-load", str(tmp_path / "none"),
                                 "--offload-roles", "critic,fake_score", "--train-iters", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and err == ("ConfigError: --offload-roles critic,fake_score: 'fake_score' is not a role of this "
                               "method (its roles: student, critic, teacher)\n"), err
    assert parse_dmd2_args(["--teacher-load", "x", "--offload-roles", "teacher"]).dmd2.offload_set(
        ("student", "critic", "teacher")) == frozenset(["teacher"])
