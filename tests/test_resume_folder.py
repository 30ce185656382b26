"""`resume=true`: a run, a sweep and an Optuna study continued in their own folders. The
finished jobs are reported as they were, the interrupted ones continue from their
last.ckpt, the others run. Every test runs real processes (the bad input is checked
in-process, in tests/test_bad_input.py)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import (
    FIRST_EPOCH_STEPS,
    ROOT,
    TWO_EPOCHS,
    interrupt_after_first_epoch,
    results,
    start,
    train,
)

from ddp_template.tools.report import load_rows


def weights(job: Path) -> dict[str, torch.Tensor]:
    return torch.load(job / "model.pt", weights_only=True)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_run_resumes_in_its_own_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(*TWO_EPOCHS, f"hydra.run.dir={run}", cwd=tmp_path)
    uninterrupted = weights(run)
    interrupt_after_first_epoch(run)

    train(*TWO_EPOCHS, f"hydra.run.dir={run}", "resume=true", cwd=tmp_path)
    resumed = results(run)
    assert [(a["began"], a["start_step"]) for a in resumed["attempts"]] == [
        ("fresh", 0),
        ("resume", FIRST_EPOCH_STEPS),
    ]
    assert resumed["resumed_from"] == str(run / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == 2 * FIRST_EPOCH_STEPS
    assert same_weights(weights(run), uninterrupted)


@pytest.mark.slow
def test_a_packed_sweep_resumes_where_it_stopped(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = ["-m", "launcher=packed", *TWO_EPOCHS, "seed=1,2,3", f"hydra.sweep.dir={sweep}"]
    train(*command, cwd=tmp_path)
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(sweep, uninterrupted)
    # Job 0 finished, job 1 was interrupted in its second epoch, job 2 never started.
    finished = sweep / "0" / "results.json"
    finished_before = (finished.stat().st_mtime_ns, results(sweep / "0")["attempts"])
    interrupt_after_first_epoch(sweep / "1")
    shutil.rmtree(sweep / "2")

    proc = train(*command, "resume=true", cwd=tmp_path)
    assert f"{sweep / '0'} finished before (resume=true): not run again" in proc.stdout
    assert (finished.stat().st_mtime_ns, results(sweep / "0")["attempts"]) == finished_before
    began = {job: [a["began"] for a in results(sweep / job)["attempts"]] for job in "12"}
    assert began == {"1": ["fresh", "resume"], "2": ["fresh"]}
    assert results(sweep / "1")["attempts"][1]["start_step"] == FIRST_EPOCH_STEPS
    assert same_weights(weights(sweep / "1"), weights(uninterrupted / "1"))
    # The same report as the uninterrupted sweep: every job's summary, the same rows.
    assert proc.stdout.count("Run summary") == 3
    rows = [(r["setting"], r["monitor_best"]) for r in load_rows(sweep)]
    assert rows == [(r["setting"], r["monitor_best"]) for r in load_rows(uninterrupted)]
    assert len(rows) == 3


@pytest.mark.slow
def test_an_optuna_sweep_continues_its_study(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = [
        "-m",
        "hparams_search=optuna_lr",
        "hydra.sweeper.n_trials=3",
        *TWO_EPOCHS,
        f"hydra.sweep.dir={sweep}",
    ]
    first = start(
        [sys.executable, str(ROOT / "train.py"), *command], cwd=tmp_path, start_new_session=True
    )
    # Killed, sweep and all, once trial 1 saved its first epoch.
    deadline = time.monotonic() + 600
    while not (sweep / "1" / "checkpoints" / "last.ckpt").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    assert (sweep / "optuna.db").is_file() and not (sweep / "1" / "results.json").exists()
    trial_0 = results(sweep / "0")

    train(*command, "resume=true", cwd=tmp_path)
    assert results(sweep / "0") == trial_0
    attempts = results(sweep / "1")["attempts"]
    assert [a["began"] for a in attempts] == ["fresh", "resume"] and attempts[1]["start_step"] > 0
    trials = [results(sweep / str(n)) for n in range(3)]
    assert not (sweep / "3").exists()
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(t["val/acc_best"] for t in trials)
    rates = [t["config"]["task"]["module"]["optimizer"]["lr"] for t in trials]
    assert len(set(rates)) == 3, rates


def test_results_of_a_finished_job_are_told_from_a_torn_file(tmp_path: Path) -> None:
    from ddp_template.resume.folder import finished_results

    assert finished_results(tmp_path) is None
    (tmp_path / "results.json").write_text('{"finished_at": "now", "val/acc_b')
    assert finished_results(tmp_path) is None
    (tmp_path / "results.json").write_text(json.dumps({"finished_at": "now"}))
    assert finished_results(tmp_path) == {"finished_at": "now"}


def test_a_stopped_sweep_says_how_to_continue_it(tmp_path: Path, monkeypatch) -> None:
    from ddp_template.resume.preemption import interrupted_sweep_message

    argv = ["train.py", "-m", "seed=1,2,3", "hydra.sweep.dir=old", "resume=true"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(tmp_path)
    line = interrupted_sweep_message(signal.SIGINT, tmp_path / "sweep")
    assert line.startswith("stopped by SIGINT; resume the sweep with: ")
    command = shlex.split(line.split("resume the sweep with: ", 1)[1])
    assert command == [
        sys.executable,
        "train.py",
        "-m",
        "seed=1,2,3",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "resume=true",
    ]
