"""`launcher=packed`: a sweep's jobs side by side on disjoint shares of the machine, with the
sweep folder, report and exit code of the sequential launcher. Every test runs real sweeps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.runs import FAST, ROOT, results, train

CORES = len(os.sched_getaffinity(0))
# A small job that trains in one process (a multilayer perceptron on a bundled table).
TABULAR = ["task=tabular_classification", *FAST]
LANE_PROBE = "+callbacks.lane_probe._target_=lane_probe.LaneProbe"

needs_two_cores = pytest.mark.skipif(CORES < 2, reason="packing needs at least 2 CPU cores")


def sweep_folder(root: Path) -> Path:
    (sweep,) = [p for p in root.glob("multirun/*/*") if p.is_dir()]
    return sweep


def job_folders(root: Path) -> list[Path]:
    sweep = sweep_folder(root)
    jobs = [p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(jobs, key=lambda p: int(p.name))


def lane_records(job: Path) -> list[dict]:
    files = sorted((job / "lane_probe").glob("rank_*.json"))
    return [json.loads(f.read_text()) for f in files]


def overlap(first: list[dict], second: list[dict]) -> bool:
    """Whether two jobs were running at the same moment (from the start of the job's
    process to the end of its training)."""
    start = max(min(r["job_start"] for r in first), min(r["job_start"] for r in second))
    end = min(max(r["fit_end"] for r in first), max(r["fit_end"] for r in second))
    return start < end


@needs_two_cores
@pytest.mark.slow
def test_jobs_run_side_by_side_on_disjoint_cores(tmp_path: Path) -> None:
    train("-m", "launcher=packed", *TABULAR, "seed=1,2", LANE_PROBE, cwd=tmp_path)
    jobs = job_folders(tmp_path)
    assert [results(j)["config"]["seed"] for j in jobs] == [1, 2]
    first, second = (lane_records(j) for j in jobs)
    assert overlap(first, second)
    cores = [set(records[0]["cores"]) for records in (first, second)]
    assert not cores[0] & cores[1] and all(len(c) == CORES // 2 for c in cores)
    # Each rank sized its threads from its own cores.
    assert [r[0]["torch_threads"] for r in (first, second)] == [CORES // 2] * 2
    # The same folder and report as the sequential launcher gives.
    sweep = sweep_folder(tmp_path)
    assert (sweep / "multirun.yaml").is_file()
    for job in jobs:
        assert (job / ".hydra" / "config.yaml").is_file() and (job / "train.log").is_file()
    report = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.report", str(sweep)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert "seed=1" in report.stdout and "seed=2" in report.stdout


@needs_two_cores
@pytest.mark.slow
def test_a_failing_job_fails_alone_with_the_sequential_exit_code(tmp_path: Path) -> None:
    """Of four jobs, two have a value the checks refuse and one has its process killed while
    it trains: the fourth trains to the end, and the sweep fails as the sequential one does."""
    for side in ("packed", "sequential"):
        (tmp_path / side).mkdir()
    packed = train(
        "-m",
        "launcher=packed",
        *TABULAR,
        "data.batch_size=32,0",
        "+callbacks.kill._target_=lane_probe.KillOwnProcess",
        "+callbacks.kill.at_step=-1,0",
        cwd=tmp_path / "packed",
        check=False,
    )
    sequential = train(
        "-m", *TABULAR, "data.batch_size=0", cwd=tmp_path / "sequential", check=False
    )
    assert packed.returncode == sequential.returncode != 0
    assert "Job 1 ended with signal 9" in packed.stderr
    jobs = job_folders(tmp_path / "packed")
    assert [(j / "results.json").is_file() for j in jobs] == [True, False, False, False]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["hydra.launcher.jobs=0"], "hydra.launcher.jobs=0 is not valid"),
        ([f"devices={CORES + 1}"], f"devices={CORES + 1} is not valid: at most the {CORES} CPU"),
        ([f"hydra.launcher.jobs={CORES + 1}"], f"hydra.launcher.jobs={CORES + 1} is not valid"),
    ],
)
def test_bad_packing_is_refused_before_any_job(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    proc = train(
        "-m",
        "launcher=packed",
        "accelerator=cpu",
        *TABULAR,
        "seed=1,2",
        *overrides,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {message}"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("multirun/*/*/0"))


@needs_two_cores
@pytest.mark.slow
def test_packed_bucket_size_sweep_reads_each_size_back(tmp_path: Path) -> None:
    train(
        "-m",
        "launcher=packed",
        "hydra.launcher.jobs=2",
        "strategy=ddp",
        "devices=2",
        "strategy.bucket_cap_mb=25,50",
        *FAST,
        LANE_PROBE,
        cwd=tmp_path,
    )
    jobs = job_folders(tmp_path)
    assert [results(j)["ddp"]["bucket_cap_mb"] for j in jobs] == [25.0, 50.0]
    assert all(results(j)["world_size"] == 2 for j in jobs)
    first, second = (lane_records(j) for j in jobs)
    assert overlap(first, second)
    # Both ranks of a job on the job's cores; the jobs' cores disjoint.
    assert first[0]["cores"] == first[1]["cores"] and second[0]["cores"] == second[1]["cores"]
    assert not set(first[0]["cores"]) & set(second[0]["cores"])


@needs_two_cores
@pytest.mark.slow
def test_parallel_optuna_trials_train_one_learning_rate_on_all_ranks(tmp_path: Path) -> None:
    train(
        "-m",
        "hparams_search=optuna_lr",
        "launcher=packed",
        "hydra.launcher.jobs=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=2",
        "strategy=ddp",
        "devices=2",
        *FAST,
        LANE_PROBE,
        cwd=tmp_path,
    )
    jobs = job_folders(tmp_path)
    trials = [results(j) for j in jobs]
    ranks = [lane_records(j) for j in jobs]
    assert len(trials) == 2 and overlap(*ranks)
    for trial, records in zip(trials, ranks, strict=True):
        lr = trial["config"]["task"]["module"]["optimizer"]["lr"]
        assert [r["rank"] for r in records] == [0, 1]
        assert [r["lr"] for r in records] == [lr, lr]
    assert (
        trials[0]["config"]["task"]["module"]["optimizer"]["lr"]
        != (trials[1]["config"]["task"]["module"]["optimizer"]["lr"])
    )
    best = yaml.safe_load((sweep_folder(tmp_path) / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(t["val/acc"] for t in trials)


@needs_two_cores
@pytest.mark.slow
def test_packing_benchmark_prints_its_speed_up() -> None:
    """The figure itself depends on how busy the cores are (tiny jobs are mostly start-up):
    the benchmark is judged by its printed medians, not by a threshold here."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "packing.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("median sweep: sequential "), proc.stdout
    assert re.fullmatch(r"packing speed-up: \d+\.\d\d", lines[-1]), proc.stdout


@needs_two_cores
@pytest.mark.slow
def test_jobs_are_spawned_where_the_sweep_process_runs_a_thread(tmp_path: Path) -> None:
    """A thread in the sweep's process (a tracker's uploader) would be lost in a forked
    job: the jobs start as fresh interpreters, and the sweep ends as it would otherwise."""
    train(
        "-m",
        "launcher=packed",
        *TABULAR,
        "seed=1,2",
        LANE_PROBE,
        "+hydra.callbacks.thread._target_=lane_probe.ThreadInSweep",
        cwd=tmp_path,
    )
    jobs = job_folders(tmp_path)
    assert [results(j)["config"]["seed"] for j in jobs] == [1, 2]
    for job in jobs:
        (record,) = lane_records(job)
        assert "multiprocessing.spawn" in record["cmdline"]
