"""Guard rails of the command lines: every user mistake is ONE stderr line `<ErrorType>: <message>`
naming the flag that was given and what was expected, exit status 1, no traceback; Ctrl-C is
handled like SIGTERM with --exit-signal-handler and is one line naming the last checkpoint without.

  a. Training flags (launch/pretrain_{flow,dmd2}.py main(argv), in-process): learning rates finite
     and in range, --lr-decay-iters >= 1, counts and intervals, --eval-num-samples with
     --eval-interval, --dmd2-denoising-steps vs --dmd2-student-sigmas, --loss-trace a directory,
     --tensorboard-dir a file. The checks run before any model is built.
  b. launch/plan_memory.py main(argv): sizes and counts >= 1, guidance >= 1, memory > 0 (the trainer's flags
     with the trainer's own checks and messages; plus one real process: `--patch 0` was a ZeroDivisionError
     traceback).
  c. launch/sample.py main(argv): --load missing / absent / a file / without a checkpoint,
     --iteration not saved, a truncated checkpoint file, --out a file, counts out of range.
  d. SIGINT: ExitController with --exit-signal-handler treats it as SIGTERM (and restores the previous
     handler); run_main turns KeyboardInterrupt into one line and 130; two real flow runs interrupted
     after their third logged iteration: with the flag exit 0 with a checkpoint at the exit
     iteration, without it exit 130 and one line naming the tracker's checkpoint.
"""
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import iter_dir, latest_iteration, rank_file
from dmd2_mega.train.resilience import ExitController, run_main
from dmd2_mega.teacher_trainer import FlowTrainer
from launch import plan_memory, pretrain_dmd2, pretrain_flow
from launch import sample as sample_script
from tests.utils import PRETRAIN, REPO, python, signal_when_logged, world_of_one

pytestmark = pytest.mark.timeout(300)
INTEGRATION_FIXTURES = ("ckpt", "interrupted",)  # fixtures that launch processes: their tests are marked integration

FLOW = ["--model-size", "debug", "--micro-batch-size", "4", "--train-iters", "0", "--log-interval", "1"]
DMD2 = FLOW + ["--teacher-load", "no/such/teacher"]  # every case fails before the teacher is read


def one_line(capsys, rc: int, error: str, *needles: str) -> str:
    """rc is 1 and stderr is exactly one line `<error>: ...` holding every needle."""
    out, err = capsys.readouterr()
    assert rc == 1, f"expected exit status 1, got {rc}\n{out[-2000:]}\n{err[-2000:]}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{error}: "), err
    for n in needles:
        assert n in lines[0], f"stderr should name {n!r}: {lines[0]}"
    return lines[0]


# ---- a. training flags ----------------------------------------------------------------------------

def _file(tmp_path) -> str:
    (tmp_path / "a_file").write_text("x")
    return str(tmp_path / "a_file")


# (id, scripts, extra argv (a callable of tmp_path for paths), needles of the one line)
TRAIN_CASES = [
    ("lr-inf", "both", ["--lr", "inf"], ["--lr must be a finite number > 0, got inf"]),
    ("lr-nan", "both", ["--lr", "nan"], ["--lr must be a finite number > 0, got nan"]),
    ("lr-negative", "both", ["--lr", "-1"], ["--lr must be a finite number > 0, got -1.0"]),
    ("min-lr-nan", "flow", ["--min-lr", "nan"], ["--min-lr must be a finite number in [0, --lr=", "got nan"]),
    ("min-lr-negative", "flow", ["--min-lr", "-0.001"], ["--min-lr must be a finite number in [0, --lr="]),
    ("lr-decay-iters-0", "both", ["--lr-decay-iters", "0"], ["--lr-decay-iters must be >= 1 when given, got 0"]),
    ("critic-lr-inf", "dmd2", ["--critic-lr", "inf"], ["--critic-lr must be a finite number > 0, got inf"]),
    ("critic-lr-0", "dmd2", ["--critic-lr", "0"], ["--critic-lr must be a finite number > 0, got 0.0"]),
    ("critic-min-lr-nan", "dmd2", ["--critic-min-lr", "nan"], ["--critic-min-lr must be a finite number >= 0"]),
    ("critic-min-lr-negative", "dmd2", ["--critic-min-lr", "-1"], ["--critic-min-lr must be a finite number >= 0"]),
    ("critic-min-lr-above-lr", "dmd2", ["--critic-lr", "1e-4", "--critic-min-lr", "1e-3"],
     ["--critic-min-lr must be in [0, critic lr=0.0001]", "got 0.001"]),
    ("train-iters", "flow", ["--train-iters", "-1"], ["--train-iters must be >= 0, got -1"]),
    ("micro-batch", "flow", ["--micro-batch-size", "0"], ["--micro-batch-size must be >= 1, got 0"]),
    ("global-batch", "flow", ["--global-batch-size", "0"], ["--global-batch-size must be >= 1, got 0"]),
    ("log-interval", "flow", ["--log-interval", "0"], ["--log-interval must be >= 1, got 0"]),
    ("save-interval", "flow", ["--save-interval", "0"], ["--save-interval must be >= 1, got 0"]),
    ("eval-interval", "flow", ["--eval-interval", "0"], ["--eval-interval must be >= 1, got 0"]),
    ("eval-num-samples", "both", ["--eval-interval", "5", "--eval-num-samples", "0"],
     ["--eval-num-samples must be >= 1 with --eval-interval 5, got 0"]),
    ("steps-vs-sigmas", "dmd2", ["--dmd2-denoising-steps", "4", "--dmd2-student-sigmas", "1.0", "0.5"],
     ["--dmd2-denoising-steps 4 disagrees with --dmd2-student-sigmas 1 0.5 (2 values)"]),
    ("loss-trace-dir", "both", lambda d: ["--loss-trace", str(d)], ["--loss-trace", "is an existing directory"]),
    ("tensorboard-file", "both", lambda d: ["--tensorboard-dir", _file(d)],
     ["--tensorboard-dir", "a_file' is an existing file; expected a directory"]),
]
TRAIN_PARAMS = [pytest.param(script, extra, needles, id=f"{script}-{cid}")
                for cid, which, extra, needles in TRAIN_CASES
                for script in (("flow", "dmd2") if which == "both" else (which,))]


@pytest.mark.parametrize("script,extra,needles", TRAIN_PARAMS)
def test_training_flag_is_one_line(script, extra, needles, tmp_path, capsys):
    extra = extra(tmp_path) if callable(extra) else extra
    main, base = (pretrain_flow.main, FLOW) if script == "flow" else (pretrain_dmd2.main, DMD2)
    with world_of_one():
        rc = main(base + extra)
    one_line(capsys, rc, "ConfigError", *needles)


def test_denoising_steps_default_follows_the_sigmas():
    base = ["--teacher-load", "t"]
    assert parse_dmd2_args(base).dmd2.denoising_steps == 4
    assert parse_dmd2_args(base + ["--dmd2-denoising-steps", "2"]).dmd2.denoising_steps == 2
    d = parse_dmd2_args(base + ["--dmd2-student-sigmas", "1.0", "0.6", "0.3"]).dmd2
    assert d.denoising_steps == 3 and d.student_sigmas == [1.0, 0.6, 0.3]
    agree = ["--dmd2-denoising-steps", "3", "--dmd2-student-sigmas", "1.0", "0.6", "0.3"]
    assert parse_dmd2_args(base + agree).dmd2.denoising_steps == 3
    assert parse_flow_args(["--lr-decay-iters", "1", "--eval-interval", "2", "--eval-num-samples", "1"])


# ---- b. plan_memory.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["--patch", "0"], "--patch must be >= 1, got 0"),
    (["--patch", "-2"], "--patch must be >= 1, got -2"),
    (["--patch", "3"], "--image-size 32 is not a multiple of --patch 3"),
    (["--num-classes", "0"], "--num-classes must be >= 1, got 0"),
    (["--image-size", "-8"], "--image-size must be >= 1, got -8"),
    (["--in-channels", "0"], "--in-channels must be >= 1, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["--dmd2-denoising-steps", "0"], "--dmd2-denoising-steps must be an int >= 1, got 0"),
    (["--cond-shape", "77", "0"], "--cond-shape must be D or L D with sizes >= 1, got 77 0"),
    (["--gpu-memory-gb", "-1"], "--gpu-memory-gb must be a finite number > 0, got -1.0"),
    (["--gpu-memory-gib", "nan"], "--gpu-memory-gb must be a finite number > 0, got nan"),
    (["--dmd2-teacher-guidance-scale", "0.5"], "--dmd2-teacher-guidance-scale must be >= 1, got 0.5"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 must divide the 32 heads"),
], ids=["patch-0", "patch-negative", "patch-not-dividing", "classes", "image-size", "channels", "micro-batch",
        "dp", "denoising-steps", "cond-shape", "memory-negative", "memory-nan", "guidance", "tp-0", "tp-heads"])
def test_plan_memory_flag_is_one_line(argv, needle, capsys):
    one_line(capsys, plan_memory.main(["--model-size", "8b"] + argv), "ConfigError", needle)


@pytest.mark.integration
def test_plan_memory_process_patch_0_exits_1_without_traceback():
    res = python(os.path.join(REPO, "launch", "plan_memory.py"), ["--patch", "0"], timeout=60)
    assert res.returncode == 1 and res.stderr == "ConfigError: --patch must be >= 1, got 0\n", res.tail()


# ---- c. sample.py ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A 1-iteration debug teacher checkpoint (in-process)."""
    save = str(tmp_path_factory.mktemp("guard_cli") / "teacher")
    with world_of_one():
        FlowTrainer(parse_flow_args(["--model-size", "debug", "--micro-batch-size", "4", "--train-iters", "1",
                                     "--log-interval", "1", "--save", save])).train()
    assert latest_iteration(save) == 1
    return save


def _sample_case(case: str, ckpt: str, d) -> tuple:
    """(argv, error type, needles) of one sample.py mistake; `d` is a scratch directory."""
    out = str(d / "out")
    if case == "no-load":
        return ["--out", out], "ConfigError", ["--load is required"]
    if case == "load-absent":
        return (["--load", str(d / "nope"), "--out", out], "CheckpointError",
                [f"--load directory '{d / 'nope'}' does not exist"])
    if case == "load-file":
        return (["--load", _file(d), "--out", out], "CheckpointError",
                ["--load", "a_file' is a file; expected a checkpoint directory"])
    if case == "load-empty":
        (d / "empty").mkdir()
        return (["--load", str(d / "empty"), "--out", out], "CheckpointError",
                [f"--load {d / 'empty'} holds no checkpoint"])
    if case == "iteration-missing":
        return (["--load", ckpt, "--out", out, "--iteration", "7"], "CheckpointError",
                [f"--iteration 7: --load {ckpt} holds no iter_0000007 (saved: iter_0000001; latest: 1)"])
    if case == "iteration-negative":
        return (["--load", ckpt, "--out", out, "--iteration", "-1"], "ConfigError",
                ["--iteration must be >= 0, got -1"])
    if case == "num-samples-0":
        return (["--load", ckpt, "--out", out, "--num-samples", "0"], "ConfigError",
                ["--num-samples must be >= 1, got 0"])
    if case == "batch-size-0":
        return (["--load", ckpt, "--out", out, "--batch-size", "0"], "ConfigError",
                ["--batch-size must be >= 1, got 0"])
    if case == "steps-0":
        return ["--load", ckpt, "--out", out, "--steps", "0"], "ConfigError", ["--steps must be >= 1, got 0"]
    if case == "num-media-negative":
        return (["--load", ckpt, "--out", out, "--num-media", "-1"], "ConfigError",
                ["--num-media must be >= 0, got -1"])
    if case == "guidance":
        return ["--load", ckpt, "--out", out, "--guidance", "0.5"], "ConfigError", ["--guidance must be a finite"]
    if case == "out-file":
        return (["--load", ckpt, "--out", _file(d)], "ConfigError",
                ["--out", "a_file' is an existing file; expected a directory"])
    if case == "out-under-file":
        return (["--load", ckpt, "--out", os.path.join(_file(d), "sub")], "ConfigError",
                ["--out", "a_file' is an existing file; expected a directory"])
    assert case == "corrupt"
    bad = str(d / "bad")
    os.makedirs(os.path.dirname(rank_file(iter_dir(bad, 1), 0)))
    with open(os.path.join(bad, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    src = open(rank_file(iter_dir(ckpt, 1), 0), "rb").read()
    with open(rank_file(iter_dir(bad, 1), 0), "wb") as f:
        f.write(src[:len(src) // 2])  # truncated
    return (["--load", bad, "--out", out], "CheckpointError",
            [f"checkpoint file {rank_file(iter_dir(bad, 1), 0)} is unreadable (truncated or corrupt?)"])


@pytest.mark.parametrize("case", ["no-load", "load-absent", "load-file", "load-empty", "iteration-missing",
                                  "iteration-negative", "num-samples-0", "batch-size-0", "steps-0", "num-media-negative",
                                  "guidance", "out-file", "out-under-file", "corrupt"])
def test_sample_mistake_is_one_line(case, ckpt, tmp_path, capsys):
    argv, error, needles = _sample_case(case, ckpt, tmp_path)
    with world_of_one():
        rc = sample_script.main(["--num-samples", "2", "--steps", "1"] + argv)  # the case's flags win
    one_line(capsys, rc, error, *needles)
    assert not os.path.exists(tmp_path / "out"), "nothing is written for a mistake"


# ---- d. SIGINT ------------------------------------------------------------------------------------

def test_exit_controller_handles_sigint_like_sigterm():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    on = ExitController(True, None, 0, torch.device("cpu"))
    try:
        assert signal.getsignal(signal.SIGINT) == on._on_signal and on.check() is None
        os.kill(os.getpid(), signal.SIGINT)  # handled: sets the flag, no KeyboardInterrupt
        assert on.received and on.check() == "SIGINT received (--exit-signal-handler)"
        os.kill(os.getpid(), signal.SIGTERM)
        assert on.check() == "SIGTERM received (--exit-signal-handler)"  # the SIGTERM text is unchanged
    finally:
        on.close()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize("case", ["none", "no-save", "empty", "saved"])
def test_run_main_keyboard_interrupt_is_one_line(case, tmp_path, capsys):
    save = str(tmp_path / "ck")
    if case in ("empty", "saved"):
        os.makedirs(save)
    if case == "saved":
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("12")
    torn = []

    def train():
        raise KeyboardInterrupt

    save_dir = {"none": None, "no-save": lambda: None}.get(case, lambda: save)
    assert run_main(train, lambda: torn.append(1), save_dir=save_dir) == 130 and torn == [1]
    want = {"none": "Interrupted (SIGINT)",
            "no-save": "Interrupted (SIGINT): no checkpoint was saved (no --save)",
            "empty": f"Interrupted (SIGINT): --save {save} holds no checkpoint yet",
            "saved": f"Interrupted (SIGINT): the last complete checkpoint is {save}/iter_0000012 "
                     f"(resume with --load {save})"}[case]
    assert capsys.readouterr().err == want + "\n"


def _interrupt_after_third_log(save: str, handler: bool, timeout: float = 120) -> tuple:
    """A real flow run (debug, 100000 iterations, save every 2) sent SIGINT once iteration 3 is logged:
    (exit status, stdout, stderr)."""
    cmd = [sys.executable, PRETRAIN, "--model-size", "debug", "--micro-batch-size", "4", "--log-interval", "1",
           "--train-iters", "100000", "--save", save, "--save-interval", "2"] + (
        ["--exit-signal-handler"] if handler else [])
    res = signal_when_logged(cmd, signal.SIGINT, iteration=3, timeout=timeout)
    return res.returncode, res.stdout, res.stderr


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard_sigint")
    with ThreadPoolExecutor(2) as pool:
        futs = {h: pool.submit(_interrupt_after_third_log, str(d / f"h{int(h)}"), h) for h in (True, False)}
        return {h: (f.result(), str(d / f"h{int(h)}")) for h, f in futs.items()}


def test_sigint_with_exit_signal_handler_saves_and_exits_0(interrupted):
    (rc, out, err), save = interrupted[True]
    assert rc == 0, f"{out[-2000:]}\n{err[-2000:]}"
    m = re.search(r"> exiting at iteration (\d+): SIGINT received \(--exit-signal-handler\)", out)
    assert m, out[-2000:]
    n = int(m.group(1))
    assert n >= 3 and latest_iteration(save) == n and f"saved checkpoint at iteration {n}" in out


def test_sigint_without_handler_exits_130_naming_the_last_checkpoint(interrupted):
    (rc, out, err), save = interrupted[False]
    assert rc == 130, f"{out[-2000:]}\n{err[-2000:]}"
    n = latest_iteration(save)
    assert n is not None and n >= 2 and n % 2 == 0, n
    assert err == (f"Interrupted (SIGINT): the last complete checkpoint is {iter_dir(save, n)} "
                   f"(resume with --load {save})\n"), err
