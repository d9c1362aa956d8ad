"""The process guard of tests/conftest.py knows whose process it is (docs/testing.md, "The two tiers").

These tests are unmarked on purpose: they run under the guard. A process that a toolchain module (triton.*, torch.*
less its launchers) asks for on its own behalf passes, as Triton's `/sbin/ldconfig -p` does at its first CUDA
launch; a launch of ours (a launch/ script, torchrun, `-m` of our package) and a fork-server run are refused before
anything starts, whoever asks. A function "inside" a module is one whose globals carry that module's `__name__`
(what the guard reads off the caller's frame).
"""
import os
import re
import subprocess
import sys

import pytest

from tests.forkserver import ForkedRun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_HELP = [sys.executable, "launch/pretrain_flow.py", "--help"]
REFUSED = "mark the test @pytest.mark.integration"


def inside(module: str):
    """`start(cmd)`: subprocess.check_output(cmd), called from a function of `module`."""
    scope = {"__name__": module, "subprocess": subprocess}
    exec("def start(cmd):\n    return subprocess.check_output(cmd)\n", scope)
    return scope["start"]


def refused(caller: str):
    return pytest.raises(AssertionError, match=re.escape(f"called from {caller}): {REFUSED}"))


def test_the_toolchains_process_passes_and_the_tests_launch_is_refused():
    assert b"libc.so" in inside("triton.backends.nvidia.driver")(["/sbin/ldconfig", "-p"])  # as libcuda_dirs()
    from torch.utils.collect_env import run  # a real torch call: collect_env's `run` starts nvidia-smi, pip, ...
    assert run([sys.executable, "-c", "print('from torch')"]) == (0, "from torch", "")
    with refused(__name__):
        subprocess.run(PRETRAIN_HELP, cwd=REPO)


@pytest.mark.parametrize("cmd", [
    PRETRAIN_HELP,
    [sys.executable, os.path.join(REPO, "launch", "pretrain_flow.py"), "--help"],
    ["bash", "-c", "python launch/pretrain_flow.py --help"],
    ["bash", "-n", "launch/quickstart.sh"],
    ["torchrun", "--help"],
    [sys.executable, "-m", "torch.distributed.run", "--help"],
    [sys.executable, "-m", "dmd2_mega.eval.digits", "--help"],
], ids=["script", "absolute", "shell", "sh", "torchrun", "torch.distributed.run", "module"])
def test_a_launch_of_ours_is_refused_whoever_asks(cmd):
    with refused("triton.backends.nvidia.driver"):
        inside("triton.backends.nvidia.driver")(cmd)


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "torch.distributed.elastic.multiprocessing.api",
                                      "torch.multiprocessing.spawn"])
def test_torchs_launchers_start_the_tests_processes(launcher):
    assert inside("torch.utils.cpp_extension")([sys.executable, "-c", "print(1)"]) == b"1\n"  # torch: the toolchain
    with refused(launcher):
        inside(launcher)([sys.executable, "-c", "print(1)"])


def test_a_fork_server_run_is_always_the_tests():
    cmd = [sys.executable, "-c", "pass"]  # not a launch of ours: ForkedRun is refused for what it is
    scope = {"__name__": "triton.runtime.build", "ForkedRun": ForkedRun, "REPO": REPO, "cmd": cmd}
    for caller, call in ((__name__, lambda: ForkedRun(cmd, {}, REPO)),
                         ("triton.runtime.build", lambda: exec("ForkedRun(cmd, {}, REPO)", scope))):
        with refused(caller):
            call()
