"""tests/forkserver.py against the reference it stands in for: the same script in a fresh interpreter (subprocess.Popen
with the same argv, environment and working directory) must give the same exit status, stdout and stderr's last line,
for a normal exit, sys.exit(3), sys.exit("message"), an uncaught exception, an uncaught KeyboardInterrupt, and
SIGTERM / SIGKILL sent to the run's session; and `forkable` sends what a fork cannot reproduce to a fresh interpreter."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forkserver
from tests.utils import REPO, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = r'''
import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd() == os.environ["WANT_CWD"], "hook", os.environ.get("DMD2_MEGA_TEST_X"))
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "main", __name__)
print("own session", os.getsid(0) == os.getpid())
print("to stderr", file=sys.stderr)
case = sys.argv[1]
if case == "code":
    sys.exit(3)
if case == "message":
    sys.exit("a one-line error")
if case == "raise":
    raise ValueError("boom")
if case == "interrupt":
    raise KeyboardInterrupt
if case == "wait":
    print("waiting", flush=True)
    time.sleep(60)
'''


def both(tmp_path, case: str, sig=None):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-u", str(script), case]
    env = child_env({"DMD2_MEGA_TEST_X": "on", "WANT_CWD": REPO})
    out = {}
    for kind in ("fresh", "fork"):
        proc = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True) if kind == "fresh" else forkserver.ForkedRun(cmd, env, REPO))
        if sig is not None:
            assert proc.stdout.readline().startswith("argv")
            deadline = time.time() + 30
            while "waiting" not in proc.stdout.readline() and time.time() < deadline:
                pass
            os.killpg(proc.pid, sig)
        o, e = proc.communicate(timeout=60)
        out[kind] = (proc.returncode, [ln for ln in o.splitlines() if ln != "waiting"], e.strip().splitlines()[-1:])
    return out


@pytest.mark.parametrize("case", ["ok", "code", "message", "raise", "interrupt"])
def test_a_fork_ends_as_a_fresh_interpreter_does(tmp_path, case):
    got = both(tmp_path, case)
    assert got["fork"] == got["fresh"], got
    assert got["fork"][1][0].startswith("argv ['" + case + "'] cwd True hook on"), got
    assert got["fork"][1][1:] == ["path0 True main __main__", "own session True"], got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_signalled_fork_reports_the_signal(tmp_path, sig):
    got = both(tmp_path, "wait", sig)
    assert got["fork"][0] == got["fresh"][0] == -sig, got


def test_what_a_fork_cannot_reproduce_runs_fresh(tmp_path):
    script = str(tmp_path / "s.py")
    open(script, "w").write("")
    py = sys.executable
    assert forkserver.forkable([py, script, "--x"], None)
    assert forkserver.forkable([py, "-u", script], {"DMD2_MEGA_TEST_KILL_AT": "rank-file"})
    assert not forkserver.forkable([py, script], {"PYTHONHASHSEED": "1"})  # read at interpreter start
    assert not forkserver.forkable([py, script], {"ATEN_CPU_CAPABILITY": "default"})
    assert not forkserver.forkable([py, "-c", "pass"], None)
    assert not forkserver.forkable([py, "-m", "torch.distributed.run", script], None)
    assert not forkserver.forkable(["bash", script], None)


RANKS = r'''
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
sys.stdout.write(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {t.item()}\n")
sys.stdout.flush()  # one write per line: the ranks share the pipe
if sys.argv[1] == "fail":
    if dist.get_rank() == 1:
        sys.exit(3)
    time.sleep(60)  # torchrun stops the rank that outlives a failed one
dist.destroy_process_group()
'''


@pytest.mark.parametrize("case", ["ok", "fail"])
def test_forked_torchrun_ranks_behave_as_torchruns(tmp_path, monkeypatch, case):
    """3 gloo ranks: each sees its RANK / LOCAL_RANK / WORLD_SIZE and the all-reduced sum; when one rank exits 3 the
    others are stopped and the run exits 1, as torchrun does (the fresh torchrun is the reference)."""
    from tests.utils import run, torchrun
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "--monitor-interval=0.1", str(script), case]
    assert forkserver.torchrun_ranks(cmd, None) == (3, [sys.executable, str(script), case])
    forked = torchrun(3, str(script), [case], timeout=60)
    monkeypatch.setenv(forkserver.ENV_SWITCH, "0")  # the same command, as a real torchrun
    fresh = run(cmd, timeout=60)
    assert forked.returncode == fresh.returncode == (0 if case == "ok" else 1), (forked.tail(), fresh.tail())
    lines = sorted(ln for ln in forked.stdout.splitlines() if ln.startswith("rank"))
    assert lines == sorted(ln for ln in fresh.stdout.splitlines() if ln.startswith("rank")), (forked.tail(), fresh.tail())
    assert lines == [f"rank {r} of 3 local {r} sum 6.0" for r in range(3)], forked.tail()
    assert forked.seconds < 50, forked.tail()  # the sleeping ranks were stopped, not waited for
