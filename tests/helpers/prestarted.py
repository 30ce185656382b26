"""A prestarted interpreter for the tests' `python train.py` runs (`runs.train`).

Every `python train.py` pays about 4.5 s of CPU for its imports (torch, Lightning, and the
torchvision, torch._dynamo and scipy that torchmetrics pulls in), most of a short run and,
over the suite's few hundred runs, a quarter of its time on two cores. This process
imports the project once, then forks one child per run, as the lab's `netlab_fork` forks
its nodes: the child takes the run's working folder, environment, arguments and output
files, runs train.py as `__main__` and exits with its code. The child is a real process
running train.py's code; what it does not repeat is the import. Runs whose environment
differs from this process's (a variable a library reads as it loads) start a fresh
interpreter instead (`runs.train`).

    python tests/helpers/prestarted.py SOCKET     # prints "ready" and its environment

Protocol, one run per connection: the client sends a length-prefixed JSON request
({"args", "cwd", "env"}) with two file descriptors (stdout, stderr); the server answers
one line {"pid"} when the child has started, one line {"returncode"} when it has ended
(negative: killed by that signal, as subprocess reports it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = struct.Struct("!Q")


def serve(path: str) -> None:
    # First, as train.py imports it: its environment defaults are set before torch loads
    # (PRELOAD names torch first).
    import ddp_template.train  # noqa: F401
    from ddp_template.tools.netlab_fork import PRELOAD

    # The rest of the imports each run would pay.
    for module in PRELOAD:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", json.dumps(dict(os.environ)), flush=True)
    while True:
        connection, _ = listener.accept()
        with connection:
            request, fds = receive(connection)
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                run_child(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            # OSError: the client gave up (its timeout) and killed the child.
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 2)
    (length,) = HEADER.unpack(data[: HEADER.size])
    body = data[HEADER.size :]
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            raise ConnectionError("the request ended early")
        body += chunk
    return json.loads(body), list(fds)


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: becomes `python train.py <args>` in the request's folder and
    environment; never returns."""
    code, interrupted = 1, False
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # What train.py sets before its libraries load, as a fresh interpreter would have it.
        importlib.reload(importlib.import_module("ddp_template.launch.process_defaults"))
        from ddp_template.tools.netlab_fork import run_as_main

        program = str(ROOT / "train.py")
        sys.argv = [program, *request["args"]]
        run_as_main(program)
        code = 0
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as error:
        traceback.print_exc()
        interrupted = isinstance(error, KeyboardInterrupt)
    finally:
        # As the interpreter's own exit: the handlers registered with atexit run, and an
        # uncaught Ctrl-C ends the process by SIGINT.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
