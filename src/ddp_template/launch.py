"""How the worker processes of one job come to be.

Each Hydra job starts its own workers through PyTorch's elastic agent (the engine behind
torchrun), handing them the job's resolved config. Workers never re-read `sys.argv`, so a
Hydra multirun sweep stays one sweep. The agent gives each job a free rendezvous port,
per-rank log files, restarts and the failing rank's traceback. When the processes were
created outside (torchrun), the job trains in the process it is in.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddp_template.errors import TrainingStopped, WorkerFailed
from ddp_template.world import started_by

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


def launch(
    worker: Worker,
    config: dict[str, Any],
    nproc_per_node: int,
    job_dir: Path,
    max_restarts: int = 0,
) -> Any:
    """Runs `worker(config)` once per local device and returns rank 0's return value."""
    if nproc_per_node == 1 or processes_started_externally():
        return worker(config)

    # A fresh rendezvous store for each attempt: with the agent's shared store, restarted
    # gloo workers read the dead workers' addresses and fail to connect (or hang).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log_dir = job_dir / "logs"
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"job-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        # Port 0: the agent picks a free port, so jobs side by side never clash.
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        # Every rank's output goes to its own files; rank 0's stdout to the console as well.
        # Tracebacks are not teed: the failing rank's one is printed once, by describe_failure.
        logs_specs=JobLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.OUT}),
        log_line_prefix_template="[rank${rank}] ",
    )
    _quiet_agent_logs()
    try:
        returns = elastic_launch(launch_config, worker)(config)
    except ChildFailedError as failure:
        raise describe_failure(failure, log_dir) from None
    return returns[0]


def _quiet_agent_logs() -> None:
    """The agent logs each failed worker's traceback and every signal it sends; the failing
    rank's traceback is shown once by `describe_failure` instead. Restart notices stay."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # At Ctrl-C or SIGTERM the launching process prints one line of its own.
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage()
    )


def describe_failure(error: ChildFailedError, log_dir: Path) -> WorkerFailed:
    """The first rank that failed (by time), why, its traceback, and where its logs are."""
    rank, failure = error.get_first_failure()
    attempts = sorted(log_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    rank_logs = attempts[-1] / str(failure.local_rank) if attempts else log_dir
    traceback = ""
    if failure.exitcode < 0:
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
    summary = (
        f"Worker rank {rank} (pid {failure.pid}) {cause}. "
        f"Its output is in {rank_logs}/stdout.log and stderr.log."
    )
    return WorkerFailed(summary, details=traceback)
