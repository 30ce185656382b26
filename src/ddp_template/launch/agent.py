"""How the worker processes of one job come to be.

Each Hydra job starts its own workers through PyTorch's elastic agent (the engine behind
torchrun), handing them the job's resolved config. Workers never re-read `sys.argv`, so a
Hydra multirun sweep stays one sweep. The agent gives each job a free rendezvous port,
per-rank log files, restarts and the failing rank's traceback. When the processes were
created outside (torchrun), the job trains in the process it is in.

Workers are forked from the launching process where that is safe (`worker_start_method`): it
has already imported torch and Lightning to check the config, so workers start in a fraction
of a second instead of importing them again. Otherwise they are spawned (fresh interpreters).

The agent forks the workers after its rendezvous, while a thread of its own is alive: the
rendezvous store's server (a C++ thread, `pt_tcpstore_uv` in /proc; the only thread besides
the main one and OpenBLAS's seen in the launching process while its workers ran). That fork
is kept on purpose: the worker never uses what those threads own (it connects to a store of its own,
hosted by rank 0: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and the copied sockets and locks are
never touched), and glibc's allocator and CPython reset their own locks in the child. What
`worker_start_method` refuses to copy is a thread of the launching process from before the
agent (a tracker's uploader, a prefetcher, a native pool), whose state the worker would use.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
    get_error_handler,
    record,
)
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddp_template.errors import TrainingStopped, UserFacingError, WorkerFailed
from ddp_template.launch.leaving import leave_together
from ddp_template.launch.world import started_by

Worker = Callable[[dict[str, Any]], Any]


def processes_started_externally() -> bool:
    """torchrun (or another elastic agent), or srun with several tasks, already made one
    process per device: this process is one rank and trains in place."""
    return started_by() is not None


class JobLogsSpecs(DefaultLogsSpecs):
    """The agent's layout, `logs/attempt_<N>/<local rank>/{stdout,stderr}.log`, directly in
    the job folder (the default adds a random sub-folder per launch)."""

    def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
        os.makedirs(str(log_dir), exist_ok=True)
        return str(log_dir)


def record_failures(worker: Worker) -> Worker:
    """torch's `@record` (the failing rank's error and traceback go to its error file, for
    the agent's failure summary), except for a refusal under an external launcher: there
    the rank prints its one paragraph and exits with code 2, and torchrun's summary shows
    that exit code; a recorded traceback would bury the paragraph. Under any launcher the
    ranks of a job of several nodes leave a refusal in the order that keeps each rank's
    paragraph and exit code visible (`leaving.leave_together`)."""
    recorded = record(worker)

    @functools.wraps(worker)
    def wrapper(config: dict[str, Any]) -> Any:
        try:
            if _OWN_WORKER or not processes_started_externally():
                return recorded(config)
            try:
                return worker(config)
            except UserFacingError:
                raise
            except Exception as err:
                get_error_handler().record_exception(err)
                raise
        except UserFacingError:
            leave_together()
            raise

    return wrapper


@dataclass(frozen=True)
class Nodes:
    """A job of several nodes started by this project's agent on each node (instead of
    torchrun): where node 0 hosts the rendezvous, and how long each node waits there."""

    count: int
    rank: int
    master_addr: str
    master_port: int
    job_id: str
    local_addr: str
    timeout_s: float

    def launch_settings(self) -> dict[str, Any]:
        return {
            "min_nodes": self.count,
            "max_nodes": self.count,
            "run_id": self.job_id,
            "rdzv_endpoint": f"{self.master_addr}:{self.master_port}",
            # Node 0 hosts the store whatever its hostname resolves to (torch's guess,
            # `_matches_machine_hostname`, fails where it resolves to a loopback address).
            "rdzv_configs": {"is_host": self.rank == 0, "join_timeout": self.timeout_s},
            # The workers' MASTER_ADDR: node 0's network address, not its hostname.
            "local_addr": self.local_addr,
        }


def launch(
    worker: Worker,
    config: dict[str, Any],
    nproc_per_node: int,
    job_dir: Path,
    max_restarts: int = 0,
    nodes: Nodes | None = None,
) -> Any:
    """Runs `worker(config)` once per local device and returns rank 0's return value."""
    if processes_started_externally() or (nproc_per_node == 1 and nodes is None):
        return _in_this_process(worker, config)

    # A fresh rendezvous store for each attempt: with the agent's shared store, restarted
    # gloo workers read the dead workers' addresses and fail to connect (or hang).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # With several nodes on one shared folder, each node's agent keeps its own logs.
    log_dir = job_dir / "logs" if nodes is None else job_dir / "logs" / f"node_{nodes.rank}"
    start_method = worker_start_method(on_cuda=config.get("accelerator") == "cuda")
    one_node = {
        "min_nodes": 1,
        "max_nodes": 1,
        "run_id": f"job-{uuid.uuid4().hex[:12]}",
        # Port 0: the agent picks a free port, so jobs side by side never clash.
        "rdzv_endpoint": "localhost:0",
    }
    launch_config = LaunchConfig(
        nproc_per_node=nproc_per_node,
        rdzv_backend="c10d",
        **(nodes.launch_settings() if nodes else one_node),
        max_restarts=max_restarts,
        # How often the agent looks at its workers: also how long it waits after they ended.
        monitor_interval=0.1,
        start_method=start_method,
        # Every rank's output goes to its own files; rank 0's stdout to the console as well.
        # Tracebacks are not teed: the failing rank's one is printed once, by describe_failure.
        logs_specs=JobLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.OUT}),
        log_line_prefix_template="[rank${rank}] ",
    )
    _quiet_agent_logs()
    started = time.time()
    try:
        returns = elastic_launch(launch_config, _start_worker)(worker, config, start_method)
    except ChildFailedError as failure:
        raise describe_failure(failure, log_dir, since=started) from None
    except RendezvousError as failure:
        if nodes is None:
            raise
        raise _nodes_did_not_meet(nodes, failure) from None
    # Keyed by global rank: only node 0 holds rank 0's results.
    return returns.get(0)


def _nodes_did_not_meet(nodes: Nodes, failure: Exception) -> UserFacingError:
    import socket

    where = f"{nodes.master_addr}:{nodes.master_port}"
    this = f"Node {nodes.rank} ({socket.gethostname()})"
    if isinstance(failure, RendezvousTimeoutError):
        return UserFacingError(
            f"{this} waited {nodes.timeout_s:g} s for the {nodes.count} nodes of job "
            f"{nodes.job_id} at {where} and they did not all come. Fix: start every node "
            "with the same command, its own network.node_rank and the same network.job_id, "
            "within network.timeout_s of each other"
        )
    return UserFacingError(
        f"{this} lost the rendezvous of job {nodes.job_id} at {where} "
        f"({type(failure).__name__}): node 0, which hosts it, stopped. Fix: see node 0's "
        "output for why (its message names the cause)"
    )


def _in_this_process(worker: Worker, config: dict[str, Any]) -> Any:
    """Runs the worker here. Lightning ends a run at SIGTERM with `SIGTERMException`, a
    SystemExit without a code: the process would exit 0, as if the run had finished. It
    becomes the signal it is, which train.py reports with the command that resumes."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        return worker(config)
    except SIGTERMException:
        raise SignalException("stopped by SIGTERM", signal.SIGTERM) from None


@contextmanager
def single_threaded() -> Iterator[None]:
    """Runs the launching process's own work (checks that build the model) on one torch
    thread. A GNU OpenMP team that ran a parallel region here would be copied into forked
    workers without its threads, and a worker's first parallel region would hang; with one
    thread no team is ever made. The thread count is restored after, for a job that trains
    in this process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def worker_start_method(on_cuda: bool) -> str:
    """`fork` where a copy of this process makes a sound worker, else `spawn`.

    Not beside another thread of this process, native ones included (a tracker's uploader,
    a prefetcher, a C++ pool): the copy would hold its locks and state without the thread.
    Native pools that handle fork themselves (OpenBLAS) do not count; torch's OpenMP pool
    is kept from starting by `single_threaded`. For workers on CUDA, not once
    a forked child could no longer use CUDA: CUDA initialised here, or the devices counted
    through the CUDA runtime (MIG, no NVML; see `cuda_devices`). Workers on the CPU never
    touch CUDA, so such a fork serves them.
    """
    from ddp_template.launch.cuda_devices import (
        forked_child_can_use_cuda,
        threads_a_fork_would_lose,
    )

    if sys.platform != "linux" or threads_a_fork_would_lose() > 0:
        return "spawn"
    if on_cuda and not forked_child_can_use_cuda():
        return "spawn"
    return "fork"


# True in a worker this project's agent started (its failures are described by that agent
# from their error files), False under torchrun, srun or in the launching process.
_OWN_WORKER = False


def in_own_worker() -> bool:
    """This process is a worker this project's agent started (the launching process then
    reports how the job ended)."""
    return _OWN_WORKER


def _start_worker(worker: Worker, config: dict[str, Any], start_method: str) -> Any:
    """The worker process's entry: a forked one first drops what it copied of the launching
    process and would not have as a fresh interpreter."""
    global _OWN_WORKER
    _OWN_WORKER = True
    if start_method != "fork":
        return worker(config)
    _forget_launching_process()
    try:
        with own_exit_functions(on_error=False):
            return worker(config)
    except Exception:
        # The worker's own error file (`@record`) holds the error, written when it
        # happened. End now: the agent names the rank whose process ended first, and exit
        # functions (the process group's among them) would let the ranks this failure
        # brings down end before this one. The agent's wrapper would also write the error
        # again, later than theirs.
        raise SystemExit(1) from None


@contextmanager
def own_exit_functions(on_error: bool = True) -> Iterator[None]:
    """A forked process ends without the interpreter's exit (multiprocessing calls
    `os._exit`): this runs the exit functions registered inside the block, as a spawned
    process would at its end (loggers close their runs there), and not the copies of the
    parent's; after an error too unless `on_error` is false."""
    atexit._clear()
    try:
        yield
    except BaseException:
        if on_error:
            atexit._run_exitfuncs()
        raise
    atexit._run_exitfuncs()


def _forget_launching_process() -> None:
    # The agent's signal handlers and the launching process's log handlers (Hydra's
    # console and train.log) belong to that process.
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.getLogger().handlers.clear()
    # Lightning reads the rank from the environment when it is imported: this copy imported
    # it before the agent set RANK.
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = int(os.environ["RANK"])


def _quiet_agent_logs() -> None:
    """The agent logs each failed worker's traceback and every signal it sends; the failing
    rank's traceback is shown once by `describe_failure` instead. Restart notices stay."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # At Ctrl-C or SIGTERM the launching process prints one line of its own.
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage()
    )


# What a rank reports when another rank died under it: a consequence, not the cause.
_BROUGHT_DOWN = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo/transport",
    "distbackenderror",
    "distnetworkerror",
    "communicator was aborted",
)


def _failure_order(failure: Any) -> tuple[int, int, int]:
    """The cause first: a rank killed by a signal (it left no error file), then a rank with
    an error of its own, then ranks whose collectives broke because a peer died; within
    each, by time (the agent's whole seconds, then when the error file was written)."""
    error_file = Path(failure.error_file)
    written = error_file.stat().st_mtime_ns if error_file.is_file() else 0
    if failure.exitcode < 0 or isinstance(failure, SilentEnd):
        kind = 0
    else:
        kind = 2 if _brought_down(failure) else 1
    return kind, failure.timestamp, written


def every_failure(error: ChildFailedError, since: float) -> dict[int, ProcessFailure]:
    """The failures the agent reported, and those of the ranks it did not: it reports the
    first ended process it sees, and when a rank's error breaks another's collective and
    both end between two of its looks (a loaded machine), that may be the other one. Each
    rank that raised wrote its error file (written after `since`) beside the reported one's,
    `logs/attempt_<N>/<local rank>/error.json`."""
    failures = dict(error.failures)
    for rank, reported in error.failures.items():
        attempt = Path(reported.error_file).parent.parent
        for error_file in attempt.glob("*/error.json"):
            local_rank = int(error_file.parent.name)
            other = rank - reported.local_rank + local_rank
            if other not in failures and error_file.stat().st_mtime >= since:
                # Its pid and exit code are not known: it raised, and exited with 1.
                failures[other] = ProcessFailure(local_rank, -1, 1, str(error_file))
        if _brought_down(reported):
            # A rank that left no error file ended without raising: killed by a signal
            # (the OOM killer, a user) or crashed in native code; its exit code is not known.
            for folder in attempt.iterdir():
                if not folder.name.isdigit() or (folder / "error.json").exists():
                    continue
                other = rank - reported.local_rank + int(folder.name)
                if other not in failures:
                    failures[other] = SilentEnd(int(folder.name), -1, 1, str(folder / "error.json"))
    return failures


class SilentEnd(ProcessFailure):
    """A rank that ended without an error of its own while the agent reported another."""


def _brought_down(failure: ProcessFailure) -> bool:
    message = failure.message
    text = str(message.get("message", "") if isinstance(message, dict) else message).lower()
    return any(marker in text for marker in _BROUGHT_DOWN)


def describe_failure(error: ChildFailedError, log_dir: Path, since: float = 0) -> WorkerFailed:
    """The rank whose failure caused the others', why, its traceback, and where its logs are."""
    failures = every_failure(error, since)
    rank, failure = min(failures.items(), key=lambda item: _failure_order(item[1]))
    attempts = sorted(log_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    rank_logs = attempts[-1] / str(failure.local_rank) if attempts else log_dir
    traceback = ""
    if isinstance(failure, SilentEnd):
        cause = (
            "ended without an error of its own, before the ranks it brought down: killed by "
            "a signal (SIGKILL from the OOM killer or a user, ...) or crashed in native code"
        )
    elif failure.exitcode < 0:
        cause = f"was killed by {failure.signal_name()}"
    else:
        message = failure.message
        if isinstance(message, dict):
            traceback = str(message.get("extraInfo", {}).get("py_callstack", "")).rstrip()
            message = message.get("message", "")
        message = str(message).strip()
        stopped = f"{TrainingStopped.__name__}: "
        if message.startswith(stopped):
            # A diagnosis made on purpose (desync, hang, unused parameters): no traceback.
            message, traceback = message[len(stopped) :].rstrip("."), ""
        cause = f"exited with code {failure.exitcode}: {message}"
    pid = f" (pid {failure.pid})" if failure.pid > 0 else ""
    summary = (
        f"Worker rank {rank}{pid} {cause}. Its output is in {rank_logs}/stdout.log and stderr.log."
    )
    return WorkerFailed(summary, details=traceback)
