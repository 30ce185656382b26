"""`python thread_probe.py`: the workers' start method in a fresh process, alone and beside
each kind of thread a launching process may hold, printed as JSON."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy  # noqa: F401  (OpenBLAS, which starts its pool of server threads as it loads)
import torch

from ddp_template.launch.agent import worker_start_method


def method() -> str:
    return worker_start_method(on_cuda=False)


def after_threads_end() -> str:
    # The kernel lists a joined thread until it has quite finished exiting.
    deadline = time.monotonic() + 5
    while method() != "fork" and time.monotonic() < deadline:
        time.sleep(0.01)
    return method()


found = {"alone": method()}
release = threading.Event()
thread = threading.Thread(target=release.wait)
thread.start()
found["python_thread"] = method()
release.set()
thread.join()
found["python_thread_ended"] = after_threads_end()
# A TCPStore's server: a C++ thread that `threading` does not list.
store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
found["native_thread"] = method()
del store
found["native_thread_ended"] = after_threads_end()
# A parallel region on two threads leaves GNU OpenMP's team alive.
torch.set_num_threads(2)
x = torch.randn(800, 800)
(x @ x).sum()
found["openmp_team"] = method()
# A process forked from this one: OpenBLAS's pool does not run there, and a Python thread
# there is still one a fork would lose (not to be taken for one of OpenBLAS's).
read, write = os.pipe()
child = os.fork()
if child == 0:
    os.close(read)
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    os.write(write, method().encode())
    release.set()
    thread.join()
    os._exit(0)
os.close(write)
found["python_thread_in_a_forked_process"] = os.read(read, 16).decode()
os.waitpid(child, 0)
print(json.dumps(found))
