"""Nothing of a finished run is lost or silently changed (issue 50, defects 1, 3, 4, 6, 8, 11), in-process:
  1   a fresh run onto a --save (or a <save>_critic) that holds checkpoints is refused, the folders byte-for-byte
      unchanged, unless it resumes from there (--load) or gives --overwrite-save, which the start-up log says;
  11  a run that fails its start-up checks leaves nothing in --save (no folder, no lock file);
  3/4 a resume compares every setting that changes the maths, None included, and the method;
  6   a LoRA run given as a full-weight init (--student-load) is merged into its base on load, saying so;
  8   every --<role>-load is checked for the run's model family, as --teacher-load is.
"""
import os
import shutil

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.errors import CheckpointError
from dmd2_mega.methods.causal_init.method import CausalInitMethod
from dmd2_mega.methods.dmd2.method import DMD2Method, DMD2Trainer
from dmd2_mega.methods.self_forcing.method import SelfForcingMethod
from dmd2_mega.methods.trainer import StudentTrainer
from dmd2_mega.teacher_trainer import FlowTrainer
from dmd2_mega.train.checkpoint import TRACKER, iter_dir, load_payload, rank_file
from dmd2_mega.train.checkpoint_guard import RESUME_SETTINGS, check_resume
from dmd2_mega.train.lora_checkpoint import merged_payload
from tests.test_guard_rails_checkpoints import DMD2, tree_hash
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run(debug_teacher, tmp_path_factory):
    """A finished DMD2 run: student + critic saved at cycles 1 and 2."""
    save = str(tmp_path_factory.mktemp("finished") / "run")
    with world_of_one():
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "2",
                                            "--save-interval", "1", "--save", save])).train()
    return save


def hashes(*dirs):
    return [tree_hash(d) for d in dirs]


# ---- 1. a fresh run never writes over a finished one --------------------------------------------------

@pytest.mark.parametrize("onto", ["run", "run_critic"])
def test_a_fresh_run_onto_a_finished_run_is_refused(debug_teacher, run, onto):
    """Defect 1: the same run without --load, another seed, onto R (or onto R_critic, another run's folder)."""
    save = run if onto == "run" else run + "_critic"
    before = hashes(run, run + "_critic")
    with world_of_one(), pytest.raises(CheckpointError, match=(
            rf"--save {save} holds checkpoints up to iteration 2 of another run; this run would write over them\. "
            rf"Resume it with --load {save}, choose another --save, or give --overwrite-save")):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "2", "--seed", "5",
                                            "--save", save]))
    assert hashes(run, run + "_critic") == before
    assert not os.path.exists(run + "_critic_critic")


def test_a_fresh_run_onto_a_runs_critic_folder_is_refused(debug_teacher, run, tmp_path):
    """--save S whose S_critic holds another run's critic (S itself empty): refused too, naming S_critic."""
    save = str(tmp_path / "s")
    shutil.copytree(run + "_critic", save + "_critic")
    before = tree_hash(save + "_critic")
    with world_of_one(), pytest.raises(CheckpointError, match=r"--save's critic directory .*s_critic holds "
                                                              r"checkpoints up to iteration 2 of another run"):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "1", "--save", save]))
    assert tree_hash(save + "_critic") == before and not os.path.exists(save)


def test_a_resume_and_an_explicit_overwrite_may_write_there(debug_teacher, run, tmp_path, capsys):
    copy = str(tmp_path / "copy")
    for suffix in ("", "_critic"):
        shutil.copytree(run + suffix, copy + suffix)
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "3",
                                                 "--load", copy, "--save", copy]))
        assert tr.iteration == 2  # the resume: allowed
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "1",
                                            "--save", copy, "--overwrite-save"]))
    out = capsys.readouterr().out
    assert f"> --overwrite-save: --save {copy} holds checkpoints up to iteration 2 of another run; this run " \
           "writes over them" in out
    assert f"--save's critic directory {copy}_critic holds checkpoints up to iteration 2" in out


def test_the_teacher_trainer_keeps_a_finished_teacher(debug_teacher, tmp_path):
    teacher = str(tmp_path / "teacher")
    shutil.copytree(debug_teacher, teacher)
    before = tree_hash(teacher)
    flags = ["--model-size", "debug", "--micro-batch-size", "8", "--lr", "3e-3", "--seed", "5", "--train-iters", "10",
             "--save", teacher]  # tests.utils.train_debug_teacher's
    with world_of_one(), pytest.raises(CheckpointError, match=rf"--save {teacher} holds checkpoints up to "
                                                              r"iteration 10 of another run"):
        FlowTrainer(parse_flow_args(flags))
    assert tree_hash(teacher) == before
    with world_of_one():
        assert FlowTrainer(parse_flow_args(flags + ["--load", teacher])).iteration == 10  # a resume: allowed


# ---- 11. a failed start leaves nothing ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["data", "causal-init"])
def test_a_run_that_fails_its_checks_leaves_no_save_folder(debug_teacher, tmp_path, case):
    """A teacher trained on digits given moving-digits data, and the causal init given data that is not a trajectory
    set: both refused after the old lock point; --save must not exist afterwards (it held .dmd2_mega.lock)."""
    save = str(tmp_path / "new")
    with world_of_one(), pytest.raises(Exception) as caught:
        if case == "data":
            DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--data", "moving-digits",
                                                "--save", save]))
        else:
            StudentTrainer(parse_dmd2_args(["--model-size", "debug", "--teacher-load", debug_teacher, "--data",
                                            "digits", "--save", save]), CausalInitMethod)
    assert ("was trained on data" if case == "data" else "--data digits") in str(caught.value)
    assert not os.path.exists(save) and not os.path.exists(save + "_critic")


# ---- 3 / 4. a resume compares every setting, None included, and the method -----------------------------

def _args(**parts) -> dict:
    return {part: dict(values) for part, values in parts.items()}


@pytest.mark.parametrize("settings, flag, saved, now", [
    (RESUME_SETTINGS, "--causal-local-attn-chunks", _args(model={"causal_local_attn_chunks": None}),
     _args(model={"causal_local_attn_chunks": 2})),  # defect 3: a window added on resume
    (RESUME_SETTINGS, "--causal-local-attn-chunks", _args(model={"causal_local_attn_chunks": 2}),
     _args(model={"causal_local_attn_chunks": None})),
    (RESUME_SETTINGS, "--causal-context-noise", _args(model={"causal_context_noise": 0.0}),
     _args(model={"causal_context_noise": 0.1})),
    (DMD2Method.resume_settings, "--distill-method", _args(dmd2={"distill_method": "self-forcing"}),
     _args(dmd2={"distill_method": "dmd2"})),  # defect 4: Self-Forcing resumed as plain DMD2
    (SelfForcingMethod.resume_settings, "--self-forcing-rollout-frames",
     _args(dmd2={"self_forcing_rollout_frames": 12}), _args(dmd2={"self_forcing_rollout_frames": 16})),
    (SelfForcingMethod.resume_settings, "--causal-grad-chunks", _args(dmd2={"causal_grad_chunks": None}),
     _args(dmd2={"causal_grad_chunks": 1})),
    (DMD2Method.resume_settings, "--dmd2-teacher-guidance-scale", _args(dmd2={"teacher_guidance_scale": 1.0}),
     _args(dmd2={"teacher_guidance_scale": 2.0})),
    (DMD2Method.resume_settings, "--dmd2-gan-sigma-range", _args(gan={"enabled": True, "sigma_range": None}),
     _args(gan={"enabled": True, "sigma_range": (0.1, 0.3)})),
])
def test_a_resume_names_every_changed_setting_none_included(settings, flag, saved, now):
    with pytest.raises(CheckpointError, match=rf"--load R: {flag} was .* when it was saved, this run has "):
        check_resume({"args": saved}, now, settings, "R")
    check_resume({"args": saved}, saved, settings, "R")  # unchanged: resumes
    check_resume({"args": {}}, now, settings, "R")  # an older checkpoint that does not record it: not compared


def test_the_gan_heads_settings_are_compared_where_this_run_has_the_head():
    saved = _args(gan={"enabled": True, "disc_weight": 1.0})
    check_resume({"args": saved}, _args(gan={"enabled": False, "disc_weight": 0.01}), DMD2Method.resume_settings, "R")
    with pytest.raises(CheckpointError, match="--dmd2-gan-disc-weight was 1.0 when it was saved, this run has 0.01"):
        check_resume({"args": saved}, _args(gan={"enabled": True, "disc_weight": 0.01}), DMD2Method.resume_settings,
                     "R")


def test_a_none_setting_is_shown_as_not_given():
    with pytest.raises(CheckpointError, match=r"--causal-local-attn-chunks was not given \(None\) when it was "
                                              r"saved, this run has 2"):
        check_resume({"args": _args(model={"causal_local_attn_chunks": None})},
                     _args(model={"causal_local_attn_chunks": 2}), RESUME_SETTINGS, "R")


def test_every_method_keeps_its_own_settings_on_resume():
    flags = {m: {f for f, *_ in m.resume_settings} for m in (DMD2Method, SelfForcingMethod, CausalInitMethod)}
    assert {"--distill-method", "--dmd2-critic-steps-per-rollout", "--dmd2-gan-disc-weight"} <= flags[DMD2Method]
    assert {"--self-forcing-exit", "--self-forcing-rollout-frames", "--causal-grad-chunks"} <= flags[SelfForcingMethod]
    assert {"--causal", "--causal-context-noise", "--timestep-shift"} <= flags[CausalInitMethod]


def test_a_real_resume_with_another_guidance_is_refused(debug_teacher, run, tmp_path):
    copy = str(tmp_path / "copy")
    for suffix in ("", "_critic"):
        shutil.copytree(run + suffix, copy + suffix)
    with world_of_one(), pytest.raises(CheckpointError, match=rf"--load {copy}: --dmd2-teacher-guidance-scale was "
                                                              r"1.0 when it was saved, this run has 2.0"):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "3", "--load", copy,
                                            "--save", copy, "--dmd2-teacher-guidance-scale", "2"]))


# ---- 6. a LoRA run as a full-weight init ----------------------------------------------------------------

def test_a_lora_run_as_student_init_is_merged(debug_teacher, tmp_path, capsys):
    lora = str(tmp_path / "lora")
    with world_of_one():
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "1", "--save", lora,
                                            "--student-lora-rank", "2", "--lr", "1e-2"])).train()
        tr = DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--train-iters", "1",
                                                 "--student-load", lora]))
        merged = merged_payload(load_payload(lora, tr.ps), tr.ps, "test")
        got = tr.roles["student"].model.state_dict()
        for name, want in merged["model"].items():
            if not torch.is_tensor(want):
                continue
            assert torch.is_tensor(got.get(name)) and torch.equal(got[name].float(), want.float()), name  # bit-exact
        teacher = load_payload(debug_teacher, tr.ps)["model"]
        assert any(not torch.equal(teacher[k], v) for k, v in merged["model"].items()
                   if torch.is_tensor(v))  # the adapters moved it
    assert f"> --student-load {lora} holds LoRA adapters (rank 2, student): merged into their base " \
           f"{os.path.abspath(debug_teacher)} as this run's init" in capsys.readouterr().out


# ---- 8. every --<role>-load is checked for the family ---------------------------------------------------

def test_a_critic_load_of_another_family_is_named(debug_teacher, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(debug_teacher, other)
    n = int(open(os.path.join(other, TRACKER)).read())
    path = rank_file(iter_dir(other, n), 0)
    payload = torch.load(path, weights_only=False)
    torch.save({**payload, "family": "wan"}, path)  # the same weights, recorded as another family's
    with world_of_one(), pytest.raises(CheckpointError, match=rf"--critic-load {other} holds a wan model, but this "
                                                              r"run's --model-size is a dit model"):
        DMD2Trainer(parse_dmd2_args(DMD2 + ["--teacher-load", debug_teacher, "--critic-load", other]))
