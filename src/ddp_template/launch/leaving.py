"""Every rank of a job of several nodes that stops for a refusal (its one paragraph, exit
code 2) leaves in an order that keeps that paragraph and that exit code visible.

The job's rendezvous store lives on node 0: in torchrun's agent there, or in rank 0 itself
(srun, the project's own agent). When rank 0 ends first, node 0's agent shuts down and the
store goes with it, while another node's worker may still be on its way out: that node's
torchrun agent, polling the store every 0.1 s while its worker lives, then ends with
`RendezvousConnectionError` and its traceback instead of the worker's `exitcode: 2`. So
each other rank marks its exit on the store as the last thing its interpreter does, and
rank 0 leaves after all of them (a bounded wait: a rank that never refuses does not hold
rank 0 for long), plus a moment for their processes to end and their agents to see it.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from datetime import timedelta
from typing import Any

# Seconds rank 0 waits after the last mark: the interpreter's finalisation after atexit,
# and the agent's next look at its worker (torchrun's monitor interval is 0.1 s).
LINGER_S = 3.0
# Rank 0 waits for the others' marks at most this, plus 0.1 s per rank.
WAIT_S = 10.0

_JOB: dict[str, Any] = {}


def remember_job_store(store: Any, rank: int, world_size: int) -> None:
    """The start of a job of several nodes keeps its store here (a prefix of it: keys of
    its own) for `leave_together`."""
    _JOB.update(store=store, rank=rank, world_size=world_size)


def leave_together(wait_s: float = WAIT_S, linger_s: float = LINGER_S) -> None:
    """Called on the way out of a refusal: rank 0 waits for every other rank's exit mark,
    each other rank marks its exit at interpreter exit. Does nothing for a job without a
    remembered store (one node, or a refusal before the store)."""
    store = _JOB.get("store")
    rank, world_size = int(_JOB.get("rank", 0)), int(_JOB.get("world_size", 1))
    if store is None or world_size < 2:
        return
    if rank != 0:
        atexit.register(_mark_left, store, rank)
        return
    others = [f"left/{r}" for r in range(1, world_size)]
    with contextlib.suppress(Exception):
        store.wait(others, timedelta(seconds=wait_s + 0.1 * world_size))
        time.sleep(linger_s)


def leave_process_group() -> None:
    """Destroys this process's default process group, if it has one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_process_group_at_exit() -> None:
    """A process that ends with its gloo group alive can abort in the interpreter's
    finalisation ("terminate called without an active exception": gloo's worker threads
    outlive the group, pytorch#190489). Lightning registers this only for NCCL; a
    `ddp_spawn` worker returns from `fit` or `test` and exits with its group, so its exit
    leaves it (a second registration, or a run that already left, finds nothing to do)."""
    atexit.register(leave_process_group)


def _mark_left(store: Any, rank: int) -> None:
    with contextlib.suppress(Exception):
        store.set(f"left/{rank}", "1")
