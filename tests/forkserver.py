"""A fork server for the tests' script runs: `python launch/X.py args` and torchruns without paying the imports again.

Every fresh interpreter of a launch script spends 6-8 s of CPU importing torch, megatron-core and the package before
its first line of work (a debug DMD2 run then trains in under a second). One server per pytest process imports them
once (and runs each launch script's top level, which imports what that script needs: diffusers for the conversions);
each run is then a fork of it that becomes the script's process:
  * its own session (`setsid`: the test may signal or SIGKILL the whole group, as with `start_new_session=True`),
  * the run's stdout / stderr pipes on fds 1 / 2 (passed over the unix socket), stdin /dev/null,
  * the run's environment, working directory, `sys.argv` and `sys.path[0]` (the script's folder),
  * the script executed as `__main__`; SystemExit, an uncaught exception (traceback, exit 1) and an uncaught
    KeyboardInterrupt (re-raised as SIGINT, as CPython does) end it as they end a fresh interpreter; atexit runs.
The server reaps each child and sends its wait status back on the run's connection, so `ForkedRun` reads like a
`subprocess.Popen` (`pid`, `stdout`, `stderr`, `communicate`, `returncode`; signal it with os.killpg(pid, ...)).

A `torchrun --standalone --nproc-per-node N script.py ...` of the tests is the same with N ranks: the fork becomes a
small agent that forks the ranks with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR / PORT, ...)
in its session and, as torchrun does, stops the others when one fails and exits 1 (`_agent`).

What a fork cannot give, a fresh interpreter does (`tests.utils.run` decides: `forkable`, `torchrun_ranks`): a
command other than those two, and an environment that differs from the tests' in anything but the runtime test hooks
(`DMD2_MEGA_TEST_*`; e.g. PYTHONHASHSEED, ATEN_CPU_CAPABILITY, DMD2_MEGA_MEGATRON_JIT act at start-up).
`DMD2_TEST_FORKSERVER=0` runs every command fresh (tests/test_forkserver.py compares the two).

Usage by the server itself: `python -m tests.forkserver SOCKET_PATH` (started by `server()`).
"""
from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
ENV_SWITCH = "DMD2_TEST_FORKSERVER"
RUNTIME_ENV_PREFIX = "DMD2_MEGA_TEST_"  # read by the scripts at run time: a fork honours them


def forkable(cmd: list, extra_env: Optional[dict]) -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0" or not cmd or cmd[0] != sys.executable:
        return False
    rest = cmd[1:2] if cmd[1:2] != ["-u"] else cmd[2:3]
    if not rest or not rest[0].endswith(".py") or not os.path.isfile(rest[0]):
        return False
    return all(k.startswith(RUNTIME_ENV_PREFIX) for k in (extra_env or {}))


def torchrun_ranks(cmd: list, extra_env: Optional[dict]):
    """(nproc, the ranks' `python script args`) for `python -m torch.distributed.run --standalone
    --nproc-per-node=N [--monitor-interval=S] script args` whose ranks a fork can run, else None."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if cmd[:4] != head or len(cmd) < 6 or not cmd[4].startswith("--nproc-per-node="):
        return None
    rest = cmd[5:]
    if rest and rest[0].startswith("--monitor-interval="):
        rest = rest[1:]
    ranks = [sys.executable, *rest]
    if not rest or rest[0].startswith("-") or not forkable(ranks, extra_env):
        return None
    return int(cmd[4].split("=", 1)[1]), ranks


# ---- the client side (in the pytest process) ---------------------------------------------------------------------

_server = {"proc": None, "path": None, "lock": threading.Lock()}


def server_path(env: dict) -> str:
    """The running server's socket, starting it (with the tests' child environment `env`) on first use."""
    with _server["lock"]:
        proc = _server["proc"]
        if proc is not None and proc.poll() is None:
            return _server["path"]
        path = os.path.join(tempfile.mkdtemp(prefix="dmd2_forkserver_"), "sock")
        env = {k: v for k, v in env.items() if not k.startswith(RUNTIME_ENV_PREFIX)}  # one run's hooks, not the server's
        proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", path], cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = proc.stdout.readline()  # the server prints "ready" once it has imported everything and listens
        if ready.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"the tests' fork server did not start: {ready!r}\n{proc.stderr.read()[-3000:]}")
        _server.update(proc=proc, path=path)
        atexit.register(proc.kill)
        return path


class ForkedRun:
    """One script run forked from the server, read like a `subprocess.Popen(..., text=True)` with pipes."""

    def __init__(self, cmd: list, env: dict, cwd: str, nproc: int = 0):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.conn.connect(server_path(env))
            header = json.dumps({"argv": cmd[1:], "env": env, "cwd": cwd, "nproc": nproc}).encode()
            socket.send_fds(self.conn, [len(header).to_bytes(8, "little") + header], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = io.open(out_r, "r", encoding="utf-8", errors="replace")
        self.stderr = io.open(err_r, "r", encoding="utf-8", errors="replace")
        self._reply = self.conn.makefile("r")
        self.pid = json.loads(self._reply.readline())["pid"]
        self.returncode = None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.conn.settimeout(timeout)
            try:
                line = self._reply.readline()
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            status = json.loads(line)["status"]
            self.returncode = os.waitstatus_to_exitcode(status)
            self.conn.close()
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        """(stdout, stderr) once the run has exited; TimeoutExpired after `timeout` s (call again after a kill)."""
        if not hasattr(self, "_readers"):
            self._chunks = {"out": [], "err": []}
            self._readers = [threading.Thread(target=lambda f=f, k=k: self._chunks[k].append(f.read()), daemon=True)
                             for f, k in ((self.stdout, "out"), (self.stderr, "err"))]
            for t in self._readers:
                t.start()
        self.wait(timeout)
        for t in self._readers:
            t.join(timeout)
            if t.is_alive():  # a grandchild holds the pipe: as Popen would, wait for it under the same timeout
                raise subprocess.TimeoutExpired(self.pid, timeout)
        return "".join(self._chunks["out"]), "".join(self._chunks["err"])


# ---- the server side ---------------------------------------------------------------------------------------------

def _preload() -> None:
    """torch, megatron-core and the package, through each launch script's own top level (not its __main__)."""
    sys.path.insert(0, REPO)
    import torch  # noqa: F401
    for name in sorted(os.listdir(LAUNCH)):
        if name.endswith(".py") and name != "__init__.py":
            runpy.run_path(os.path.join(LAUNCH, name), run_name="_forkserver_preload")


def _child(conn: socket.socket, lsock: socket.socket, fds: list, header: dict) -> None:
    """In the fork: its own session on the run's pipes, then the script (or, for a torchrun, the ranks' agent)."""
    try:
        lsock.close()
        conn.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if header.get("nproc"):
            _agent(header, header["nproc"])
        _run_script(header, {})
    except BaseException:  # noqa: BLE001  (the set-up itself failed: say so on the run's stderr)
        traceback.print_exc()
        os._exit(1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(header: dict, nproc: int) -> None:
    """`torchrun --standalone --nproc-per-node nproc` for one host: the ranks are forks of this process (so of the
    server: nothing imported again) in its session, with torchrun's environment; rank 0 hosts the rendezvous store
    on a free port (env://). As torchrun does, the first rank to fail gets the others SIGTERMed (SIGKILLed 5 s later)
    and the run exits 1; a rank killed by a signal counts as failed."""
    port = _free_port()
    ranks = {}
    for i in range(nproc):
        env = {"RANK": i, "LOCAL_RANK": i, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": 0,
               "GROUP_WORLD_SIZE": 1, "ROLE_RANK": i, "ROLE_WORLD_SIZE": nproc, "ROLE_NAME": "default",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
               "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": f"forkserver-{os.getpid()}"}
        pid = os.fork()
        if pid == 0:
            _run_script(header, {k: str(v) for k, v in env.items()})
        ranks[pid] = i
    code, deadline = 0, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.time() > deadline:
                for p in ranks:
                    os.kill(p, signal.SIGKILL)
                deadline = None
            time.sleep(0.02)
            continue
        rank, rc = ranks.pop(pid, None), os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code = 1
            print(f"[tests/forkserver.py torchrun] rank {rank} exited with {rc}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            for p in ranks:
                os.kill(p, signal.SIGTERM)
            deadline = time.time() + 5
    os._exit(code)


def _run_script(header: dict, extra_env: dict) -> None:
    """Become the script's process (environment, cwd, stdio, argv) and never return."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(header["env"])
        os.environ.update(extra_env)
        os.chdir(header["cwd"])
        argv = header["argv"]
        unbuffered = argv[0] == "-u" or bool(os.environ.get("PYTHONUNBUFFERED"))
        script, args = (argv[1], argv[2:]) if argv[0] == "-u" else (argv[0], argv[1:])
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        out = io.FileIO(1, "w", closefd=False)
        sys.stdout = io.TextIOWrapper(out if unbuffered else io.BufferedWriter(out), encoding="utf-8",
                                      write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def _recv_request(conn: socket.socket):
    first, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    size = int.from_bytes(first[:8], "little")
    data = first[8:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise EOFError("the client closed the connection mid-request")
        data += more
    return fds, json.loads(data)


def serve(path: str) -> None:
    _preload()
    parent = os.getppid()
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(64)
    print("ready", flush=True)
    children = {}  # pid -> the run's connection
    lsock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    while True:
        sel.select(timeout=0.02)  # a request, or 20 ms to reap exited runs
        try:
            conn, _ = lsock.accept()
        except BlockingIOError:
            conn = None
        if conn is not None:
            conn.setblocking(True)
            fds, header = _recv_request(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(conn, lsock, fds, header)
            for fd in fds:
                os.close(fd)
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall((json.dumps({"status": status}) + "\n").encode())
                except OSError:
                    pass
                conn.close()
        if os.getppid() != parent:  # the pytest process is gone
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return


if __name__ == "__main__":
    serve(sys.argv[1])
