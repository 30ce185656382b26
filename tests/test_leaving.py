"""A refusal ends the ranks of a job of several nodes with rank 0, whose node hosts the
job's store, last (launch/leaving.py): another node's torchrun agent then sees its worker's
exit code 2, not a lost store."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers.runs import free_port

from ddp_template.launch import leaving

# Rank 1: refuses, says so, then takes two seconds more on its way out.
RANK_1 = """
import sys, time
import torch.distributed as dist
from ddp_template.launch.leaving import leave_together, remember_job_store
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
remember_job_store(store, 1, 2)
leave_together()
store.set("refused/1", "1")
time.sleep(2)
"""


@pytest.fixture
def job_store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    monkeypatch.setattr(leaving, "_JOB", {})
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    leaving.remember_job_store(store, 0, 2)
    return store


@pytest.mark.slow
def test_rank_0_leaves_after_the_other_ranks_have_ended(job_store: dist.TCPStore) -> None:
    rank_1 = subprocess.Popen([sys.executable, "-c", RANK_1, str(job_store.port)])
    try:
        job_store.wait(["refused/1"], timedelta(seconds=120))
        leaving.leave_together()
        assert rank_1.poll() == 0, "rank 0 left while rank 1 was still on its way out"
        assert job_store.check(["left/1"])  # rank 1 marked its exit, rank 0 did not time out
    finally:
        rank_1.kill()
        rank_1.wait()


def test_rank_0_waits_a_bounded_time_for_a_rank_that_never_leaves(
    job_store: dist.TCPStore,
) -> None:
    started = time.monotonic()
    leaving.leave_together(wait_s=0.5, linger_s=30)
    # 0.5 s + 0.1 s per rank, and no linger after a wait that ran out.
    assert time.monotonic() - started < 5


def test_a_job_without_a_store_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leaving, "_JOB", {})
    started = time.monotonic()
    leaving.leave_together(linger_s=30)
    assert time.monotonic() - started < 1


# A DDP worker sets up its process group through the project's strategy and returns
# without leaving it, as a `ddp_spawn` worker does after `fit` or `test`; the exit function
# registered first runs last and reports whether the group was still alive then.
SPAWNED_WORKER = """
import atexit, os, sys
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from ddp_template.worker.node_agreement import NodeCheckedDDPStrategy
atexit.register(lambda: print("alive at exit:", dist.is_initialized(), flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
strategy = NodeCheckedDDPStrategy(
    accelerator=CPUAccelerator(),
    parallel_devices=[torch.device("cpu")],
    cluster_environment=LightningEnvironment(),
    process_group_backend="gloo",
    start_method="spawn",
)
strategy.setup_distributed()
print("alive after setup:", dist.is_initialized(), flush=True)
"""


def test_a_worker_that_returns_with_its_process_group_leaves_it_at_exit() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SPAWNED_WORKER, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "alive after setup: True" in done.stdout
    assert "alive at exit: False" in done.stdout, done.stdout
