"""A fork server for the tests' world-of-one script runs: `python launch/X.py args` without paying the imports again.

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
`subprocess.Popen` (`pid`, `stdout`, `stderr`, `communicate`, `send_signal`, `returncode`).

What a fork cannot give, a fresh interpreter does (`tests.utils.run` decides, `forkable`): a command other than
`python [-u] script.py ...`, an environment that differs from the tests' in anything but the runtime test hooks
(`DMD2_MEGA_TEST_*`; e.g. PYTHONHASHSEED, ATEN_CPU_CAPABILITY, DMD2_MEGA_MEGATRON_JIT act at start-up), and every
torchrun (its ranks are its own children). `DMD2_TEST_FORKSERVER=0` runs every script fresh.

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

    def __init__(self, cmd: list, env: dict, cwd: str):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.conn.connect(server_path(env))
            header = json.dumps({"argv": cmd[1:], "env": env, "cwd": cwd}).encode()
            socket.send_fds(self.conn, [len(header).to_bytes(8, "little") + header], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = io.open(out_r, "r", encoding="utf-8", errors="replace")
        self.stderr = io.open(err_r, "r", encoding="utf-8", errors="replace")
        self._reply = self.conn.makefile("r")
        self.pid = json.loads(self._reply.readline())["pid"]
        self.returncode = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

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

    def poll(self) -> Optional[int]:
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
    """In the fork: become the script's process and never return."""
    code = 1
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
        os.environ.clear()
        os.environ.update(header["env"])
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
