"""Costs that must not grow with the world size: no host-blocking collective per training
step on any launcher, figures per rank reported as min/median/max and the slowest rank (not
one key per rank), and a checkpoint whose size does not grow with the ranks. Every test runs
real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import FAST, ROOT, subprocess_env, train

STEPS = 6
PROBED = [
    "strategy=ddp",
    *[o for o in FAST if not o.startswith("trainer.limit_train_batches")],
    f"trainer.limit_train_batches={STEPS}",
    "test=false",
    "+callbacks.sync._target_=sync_probe.HostSyncProbe",
]


def probed(job: Path) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted((job / "sync_probe").glob("*.json"))]
    assert len(records) == 2, records
    return records


def assert_no_blocking_collective_per_step(records: list[dict]) -> None:
    for record in records:
        assert record["steps"] == STEPS and record["world_size"] == 2, record
        # Lightning's SIGTERM-flag broadcast (a host sync) would be called at every step.
        assert record["sigterm_broadcast"] == 0, record
        blocking = sum(record[name] for name in ("broadcast", "all_reduce", "barrier"))
        assert blocking == 0, record


@pytest.mark.slow
def test_no_host_sync_per_step_under_this_projects_agent(tmp_path: Path) -> None:
    train(*PROBED, "devices=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_no_blocking_collective_per_step(probed(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (openmpi-bin) is not installed")
def test_no_host_sync_per_step_under_mpirun(tmp_path: Path) -> None:
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    proc = subprocess.run(
        ["mpirun", *as_root, "--oversubscribe", "-np", "2", "-x", "PYTHONPATH"]
        + [sys.executable, str(ROOT / "train.py"), *PROBED, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_blocking_collective_per_step(probed(tmp_path / "run"))


def _logged_keys(run_dir: Path) -> set[str]:
    with (run_dir / "csv" / "metrics.csv").open() as file:
        return set(file.readline().strip().split(","))


def _results_keys(record: object, prefix: str = "") -> set[str]:
    """Every key path of results.json, the resolved config left out (it names devices)."""
    if not isinstance(record, dict):
        return {prefix}
    keys = set()
    for key, value in record.items():
        if key not in ("config", "attempts", "nodes", "checkpoints"):
            keys |= _results_keys(value, f"{prefix}{key}.")
    return keys


def _saved_bytes(value: object) -> int:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.tell()


# Runs at 2 and 4 ranks: PowerSGD (compression from step 3 on: errors exist after step 4),
# the CSV logger (one column per logged key).
AT_2_AND_4 = [
    "strategy=ddp",
    "data=digits",
    "data.batch_size=16",
    "strategy.comm_hook=powersgd",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=5",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "test=false",
    "logger=csv",
    "~callbacks.model_checkpoint",
]


@pytest.fixture(scope="module")
def runs_at_2_and_4(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ranks")
    for ranks in (2, 4):
        train(*AT_2_AND_4, f"devices={ranks}", f"hydra.run.dir={root / str(ranks)}", cwd=root)
    return {ranks: root / str(ranks) for ranks in (2, 4)}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_logged_figures_are_the_same_keys_at_2_and_4_ranks(runs_at_2_and_4) -> None:
    """Figures every rank has are logged as min/median/max and the slowest rank: the number
    of series a tracker gets, and results.json's keys, do not grow with the world size."""
    keys = {ranks: _logged_keys(run) for ranks, run in runs_at_2_and_4.items()}
    records = {
        ranks: json.loads((run / "results.json").read_text())
        for ranks, run in runs_at_2_and_4.items()
    }
    assert keys[2] == keys[4], keys[2] ^ keys[4]
    assert not [key for key in keys[4] if "rank_" in key], keys[4]
    for figure in ("peak_mem_mb", "data_wait_fraction", "step_time_s"):
        assert {f"perf/{figure}/{s}" for s in ("min", "median", "max", "max_rank")} <= keys[4]
    assert "perf/slowest_rank" in keys[4]
    assert _results_keys(records[2]) == _results_keys(records[4])
    spread = records[4]["peak_memory_mb_over_ranks"]
    assert spread["min"] <= spread["median"] <= spread["max"] == records[4]["peak_memory_mb"]
    assert 0 <= records[4]["slowest_rank"] < 4 and 0 <= spread["max_rank"] < 4


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_powersgd_checkpoint_does_not_grow_with_the_ranks(runs_at_2_and_4) -> None:
    """PowerSGD's error feedback is kept once (its mean over ranks), not once per rank:
    from 2 to 4 ranks the checkpoint grows by the two extra ranks' random-number states
    alone (a few KiB each, whatever the model), not by two copies of the error."""
    import torch

    paths = {r: run / "checkpoints" / "last.ckpt" for r, run in runs_at_2_and_4.items()}
    sizes = {ranks: path.stat().st_size for ranks, path in paths.items()}
    state = torch.load(paths[4], weights_only=True)["callbacks"]["ResumeState"]
    errors = [p["error"] for p in state["comm_hook"]["parameters"].values() if "error" in p]
    error_bytes = sum(e.numel() * e.element_size() for e in errors)
    assert error_bytes > 100_000, error_bytes  # the error is the model's size
    per_rank = _saved_bytes(state["ranks"][0])
    assert per_rank < 32_000
    grown = sizes[4] - sizes[2]
    # Two more ranks' generator states (each saved alone carries its own file's overhead),
    # far below one more copy of the error.
    assert grown <= 2 * per_rank and grown < error_bytes / 10, (sizes, per_rank, error_bytes)
