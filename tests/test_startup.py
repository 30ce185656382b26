"""Start-up: workers forked from the launching process (no second import of torch and
Lightning) behave as fresh processes would, the fork is refused where it is unsafe, and the
start-up benchmark runs. Every test starts real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.runs import FAST, ROOT, TESTS, subprocess_env, train

LANE_PROBE = "+callbacks.lane_probe._target_=lane_probe.LaneProbe"


@pytest.mark.slow
def test_forked_workers_start_as_fresh_processes_would(tmp_path: Path) -> None:
    job = tmp_path / "run"
    # As users start it: the workers' command line is the one typed.
    train(
        "strategy=ddp",
        "devices=2",
        *FAST,
        LANE_PROBE,
        f"hydra.run.dir={job}",
        cwd=tmp_path,
        fresh=True,
    )
    records = [json.loads((job / "lane_probe" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        # Forked: a spawned worker's command line is multiprocessing's own.
        assert "multiprocessing" not in record["cmdline"] and "train.py" in record["cmdline"]
        # Lightning knew the rank before the Trainer set it (it reads it at import).
        assert record["rank_zero_only_rank_before_trainer"] == rank
        # The launching process's log handlers (Hydra's train.log) were dropped.
        assert record["root_log_handlers"] == 0
        # The worker's own exit functions ran at its end.
        assert (job / "lane_probe" / f"exited_rank_{rank}").is_file()
    assert records[0]["parent_pid"] == records[1]["parent_pid"]
    # Lightning's messages reach each rank's own log; train.log has none of rank 1's.
    rank_one_log = (job / "logs" / "attempt_0" / "1" / "stdout.log").read_text()
    assert "GLOBAL_RANK: 1" in rank_one_log
    assert "GLOBAL_RANK: 1" not in (job / "train.log").read_text()


def test_fork_is_refused_while_another_thread_runs() -> None:
    """A thread of the launching process would be missing from a forked copy, its locks
    held: Python's, native ones (a TCPStore's server) and GNU OpenMP's team alike. Asked
    in a fresh process, which holds none of them to begin with, and in a process forked
    from it (where OpenBLAS's pool, which the count leaves out, is not running)."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "thread_probe.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["alone"] == "fork"
    assert found["python_thread"] == "spawn" and found["python_thread_ended"] == "fork"
    assert found["native_thread"] == "spawn" and found["native_thread_ended"] == "fork"
    assert found["python_thread_in_a_forked_process"] == "spawn"
    assert found["openmp_team"] == "spawn"


FORK_AFTER_PARALLEL_WORK = textwrap.dedent(
    """
    import multiprocessing, sys, torch
    from ddp_template.launch.agent import single_threaded

    def parallel_work():
        x = torch.randn(1500, 1500)
        for _ in range(3):
            (x @ x).exp_().sum()

    def child():
        torch.set_num_threads(2)
        parallel_work()

    torch.set_num_threads(2)
    if sys.argv[1] == "single_threaded":
        with single_threaded():
            parallel_work()
    else:
        parallel_work()
    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(timeout=float(sys.argv[2]))
    finished = process.exitcode == 0
    process.kill()
    print("finished" if finished else "hung")
    """
)


def _fork_after_parallel_work(mode: str, tmp_path: Path, wait_s: float) -> str:
    script = tmp_path / "fork_after_parallel_work.py"
    script.write_text(FORK_AFTER_PARALLEL_WORK)
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(wait_s)],
        capture_output=True,
        text=True,
        timeout=wait_s + 120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.slow
def test_work_of_the_launching_process_leaves_forked_workers_able_to_use_threads(
    tmp_path: Path,
) -> None:
    """GNU OpenMP's team, made by a parallel region in the parent, is copied into a forked
    child without its threads: the child's first parallel region hangs. The launching
    process does its work on one thread, so its workers can use several."""
    assert _fork_after_parallel_work("single_threaded", tmp_path, wait_s=120) == "finished"
    # The hazard itself, where torch runs on GNU OpenMP (the Linux wheels do).
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    if "libgomp" in maps:
        assert _fork_after_parallel_work("plain", tmp_path, wait_s=20) == "hung"


@pytest.mark.slow
def test_startup_benchmark_prints_its_figures() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "startup.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for phase in ("start the workers", "first step", "shut-down", "time to the first step"):
        assert any(line.startswith(phase) for line in lines), proc.stdout
    assert re.fullmatch(r"start-up ratio: \d+\.\d\d", lines[-2])
    assert re.fullmatch(r"extra start-up: -?\d+\.\d\d s", lines[-1])


_POLICY_AT_TORCH_IMPORT = """
import os, sys
class SeeTorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            seen = [os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]
            print("at torch import:", *seen)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, SeeTorchImport())
import ddp_template.train
"""


@pytest.mark.parametrize(
    ("exported", "expected"),
    [
        ({}, "None 10000"),
        ({"GOMP_SPINCOUNT": "300000"}, "None 300000"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),
    ],
)
def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise(exported, expected) -> None:
    """OpenMP reads how its threads wait once, when torch loads it: `train.py` sets it first."""
    variables = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in subprocess_env().items() if k not in variables}
    proc = subprocess.run(
        [sys.executable, "-c", _POLICY_AT_TORCH_IMPORT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, **exported},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at torch import: {expected}" in proc.stdout


@pytest.mark.slow
def test_threads_under_load_benchmark_prints_its_figures() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "threads_under_load.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for name in ("threads spin", "spin briefly", "threads sleep", "one thread"):
        assert any(name in line and re.search(r"\d+ +\d+$", line) for line in lines), proc.stdout
    assert re.fullmatch(r"under load, train.py's threads / OpenMP's default: \d+\.\dx", lines[-1])
