"""Which elastic agent started the attempts of a job folder: a worker tells a rejoin of its
agent's job (a restart of the worker group) from a rerun under the same job id (a new
agent), where torchrun's own counters cannot: it restarts the workers of a node that did
not fail with TORCHELASTIC_RESTART_COUNT still 0, and exposes no rendezvous round to them.
Light on purpose (no torch): read before anything is built.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

# Per job folder, one empty file per worker process an elastic agent (torchrun, this
# project's) started there: `<host>.<agent pid>.<agent start>.<pid>.<start>`.
AGENT_RECORDS = ".agents"


def rejoined_by_agent(job_dir: Path) -> bool:
    """Whether the elastic agent that started this worker started an earlier attempt of
    this job folder: a rejoin after a restart of the worker group, also on a node whose
    workers did not fail (torchrun then leaves TORCHELASTIC_RESTART_COUNT at 0), not a
    rerun under the same job id (a new agent). Told by the records of the agent's earlier
    workers (`note_agent_attempt`): their processes have ended, this attempt's still run."""
    agent = _agent_key()
    if agent is None:
        return False
    for record in (job_dir / AGENT_RECORDS).glob(f"{agent}.*"):
        pid, started = record.name.rsplit(".", 2)[1:]
        if _started_at(int(pid)) != started:
            return True
    return False


def note_agent_attempt(job_dir: Path) -> None:
    """Records this worker of its agent's attempt (see `rejoined_by_agent`), once the
    attempt was found to start or continue rightly."""
    agent = _agent_key()
    if agent is None:
        return
    folder = job_dir / AGENT_RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{agent}.{os.getpid()}.{_started_at(os.getpid())}").touch()


def _agent_key() -> str | None:
    """This worker's elastic agent, its parent process, named by host, pid and start time
    (a pid alone is reused); None outside an elastic agent."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    agent = os.getppid()
    started = _started_at(agent)
    return None if started is None else f"{socket.gethostname()}.{agent}.{started}"


def _started_at(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (/proc/<pid>/stat, field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]
