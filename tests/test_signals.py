"""Signals have one owner each: Ctrl-C or SIGTERM stop a DDP run at once with one line that
says how to resume; the watchdog dumps stacks on SIGQUIT (SIGUSR1/2 belong to SLURM
preemption) and its thread never outlives the job it watches."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.runs import CPU, FAST, ROOT, start, train

LONG_DDP = [
    CPU,
    "strategy=ddp",
    "devices=2",
    "data=synthetic",
    "data.num_samples=2560",
    "data.eval_samples=32",
    "data.image_size=8",
    "data.batch_size=32",
    "trainer.max_epochs=50",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "logger=none",
    "debug=watchdog",
    "hydra.run.dir=run",
]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches every process.
    return start([sys.executable, str(ROOT / "train.py"), *args], cwd, start_new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c to every process", "SIGTERM to the launcher"])
def test_a_stopped_run_ends_at_once_and_says_how_to_resume(tmp_path: Path, how: str) -> None:
    proc = _start(LONG_DDP, tmp_path)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not last.is_file():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    launcher = psutil.Process(proc.pid)
    workers = launcher.children(recursive=True)
    # The ranks: the agent's children, spawned (spawn_main) or forked (the same command line).
    ranks = [
        p
        for p in launcher.children()
        if "spawn_main" in " ".join(p.cmdline()) or p.cmdline() == launcher.cmdline()
    ]
    assert len(ranks) == 2
    # The watchdog's stack dump answers SIGQUIT and leaves the rank running.
    ranks[0].send_signal(signal.SIGQUIT)
    time.sleep(2)
    assert ranks[0].is_running()

    saved_before = last.stat().st_mtime_ns
    stopped = time.time()
    if how == "ctrl-c to every process":
        os.killpg(proc.pid, signal.SIGINT)
        signum = signal.SIGINT
    else:
        proc.send_signal(signal.SIGTERM)
        signum = signal.SIGTERM
    out, err = proc.communicate(timeout=120)
    took = time.time() - stopped
    # Well under the elastic agent's 30 s before it SIGKILLs workers that do not stop.
    assert took < 25, f"took {took:.1f} s"
    assert proc.returncode == 128 + signum
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    name = signal.Signals(signum).name
    assert line.startswith(f"error: stopped by {name}; the last checkpoint is {last}")
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:2] == [sys.executable, str(ROOT / "train.py")]
    # The same folder: a new one (ckpt_path=) would start a new best-model record.
    assert command[-2:] == [f"hydra.run.dir={tmp_path / 'run'}", "resume=true"]
    assert "strategy=ddp" in command and "hydra.run.dir=run" not in command
    # Every rank saved at the signal, at a step all of them agreed on.
    assert last.stat().st_mtime_ns > saved_before
    assert f"Preempted ({name}): saved {last} at step" in out, out[-3000:]
    stacks = (tmp_path / "run" / "logs" / "attempt_0").glob("*/stderr.log")
    assert any("most recent call first" in f.read_text() for f in stacks)


@pytest.mark.slow
def test_a_failed_sweep_job_leaves_no_watchdog_armed(tmp_path: Path) -> None:
    """Job 0 fails in its first step; its watchdog (timeout 8 s) must not fire later and
    end the sweep process while job 1 trains (9 steps of at least 1 s each)."""
    proc = train(
        "-m",
        *FAST,
        "trainer.max_epochs=3",
        "debug=watchdog",
        "callbacks.hang_watchdog.timeout_s=8",
        "+callbacks.fail._target_=slurm_probe.FailAtStep",
        "+callbacks.fail.fail=true,false",
        "+callbacks.fail.step=0",
        "+callbacks.slow._target_=slurm_probe.StepProbe",
        "+callbacks.slow.step_s=1",
        cwd=tmp_path,
        check=False,
        timeout=400,
    )
    assert "injected failure at step 0" in proc.stderr
    assert "Hang: no progress" not in proc.stdout + proc.stderr
    (sweep,) = [p for p in (tmp_path / "multirun").glob("*/*") if p.is_dir()]
    assert not (sweep / "0" / "results.json").exists()
    assert (sweep / "1" / "results.json").is_file(), proc.stderr[-3000:]


def test_the_resume_command_names_the_running_interpreter(tmp_path: Path, monkeypatch) -> None:
    """Typed in the folder the run was started from, it runs this interpreter (the project's
    .venv/bin/python from the project's folder), not whatever `python` is on the PATH, and
    continues in the run's own folder."""
    from ddp_template.resume.preemption import interrupted_message

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["train.py", "strategy=ddp"])
    project = Path(sys.executable).parents[2]
    for folder, interpreter in (
        (project, Path(sys.executable).relative_to(project)),
        (tmp_path, sys.executable),
    ):
        monkeypatch.chdir(folder)
        overrides = ["strategy=ddp", "hydra.run.dir=x", "resume=false"]
        line = interrupted_message(signal.SIGINT, tmp_path, overrides)
        command = shlex.split(line.split("resume with: ", 1)[1])
        assert (folder / command[0]).is_file()
        assert command == [
            str(interpreter),
            "train.py",
            "strategy=ddp",
            f"hydra.run.dir={tmp_path}",
            "resume=true",
        ]


def _first_stops(rank: int, port: int, results) -> None:
    """Rank 1 alone notes a signal before step 7; for each lag, each rank records the first
    step at which the agreement says stop."""
    import torch.distributed as dist

    from ddp_template.resume.preemption import FlagAgreement

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for lag in (0, 2):
        agreement = FlagAgreement(lag, torch.device("cpu"))
        stops = [s for s in range(12) if agreement.step(2 if rank == 1 and s >= 7 else 0)]
        agreement.drain()
        results.put((lag, rank, stops[0]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step() -> None:
    """The all-reduce started at step 7 is read `lag` steps later, on both ranks alike."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    mp.start_processes(_first_stops, args=(port, results), nprocs=2, start_method="spawn")
    assert sorted(results.get() for _ in range(4)) == [(0, 0, 7), (0, 1, 7), (2, 0, 9), (2, 1, 9)]


def test_flag_agreement_without_a_process_group_reads_its_own_flag_later() -> None:
    from ddp_template.resume.preemption import FlagAgreement

    agreement = FlagAgreement(2, torch.device("cpu"))
    assert [agreement.step(flag) for flag in (0, 1, 2, 0)] == [0, 0, 0, 1]
    assert agreement.drain() == 2 and agreement.drain() == 0


def test_decide_after_steps_must_be_a_whole_number() -> None:
    from ddp_template.errors import ConfigError
    from ddp_template.resume.preemption import PreemptionCheckpoint

    with pytest.raises(ConfigError, match="decide_after_steps=-1 is not valid"):
        PreemptionCheckpoint(decide_after_steps=-1)


def test_a_preempted_rank_leaves_sigterm_ignored_while_it_ends() -> None:
    """The requeue's SIGTERM may arrive while Lightning shuts down: restored, Lightning's
    handler would broadcast to a rank already gone and the job would record a failure."""
    from ddp_template.resume.preemption import Preempted, PreemptionCheckpoint

    before = signal.getsignal(signal.SIGTERM)
    try:
        for exception, expected in ((Preempted(143), signal.SIG_IGN), (RuntimeError(), before)):
            callback = PreemptionCheckpoint()
            callback._previous = {signal.SIGTERM: before}
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            callback.on_exception(None, None, exception)
            assert signal.getsignal(signal.SIGTERM) == expected
    finally:
        signal.signal(signal.SIGTERM, before)


def test_lightnings_per_step_sigterm_broadcast_is_off_while_the_callback_owns_sigterm() -> None:
    import lightning as L

    from ddp_template.resume.preemption import (
        PreemptionCheckpoint,
        _skip_lightnings_sigterm_broadcast,
    )

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    loop = trainer.fit_loop.epoch_loop
    callback = PreemptionCheckpoint()
    callback._trainer_loop = _skip_lightnings_sigterm_broadcast(trainer)
    assert callback._trainer_loop is loop and loop._broadcast_sigterm_tensor() is None
    callback._disarm()
    assert loop._broadcast_sigterm_tensor.__func__ is type(loop)._broadcast_sigterm_tensor


@pytest.mark.slow
def test_the_preemption_cost_benchmark_prints_every_mode_side_by_side() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "preemption_cost.py"),
            "--repeats=1",
            "--warmup-steps=2",
            "--steps=5",
            "--width=16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.strip().splitlines()[-4:]
    labels = ["no check", "before:", "blocking", "deferred"]
    for line, label in zip(table, labels, strict=True):
        assert line.startswith(label), proc.stdout
        step, check, _extra = (float(x) for x in line.split()[-4:-1])
        assert step > 0 and check >= 0
    assert table[-1].endswith(" 1.0x") and table[0].endswith(" -")


@pytest.mark.slow
def test_sigterm_to_a_one_process_run_exits_with_the_resume_line(tmp_path: Path) -> None:
    """Lightning ends a run at SIGTERM with a SystemExit that has no code: a run trained in
    the launching process would exit 0, as if it had finished."""
    one_process = [a for a in LONG_DDP if a not in ("strategy=ddp", "devices=2", "debug=watchdog")]
    proc = _start([*one_process, "devices=1"], tmp_path)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not last.is_file():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: stopped by SIGTERM; the last checkpoint is {last}")
    assert not (tmp_path / "run" / "results.json").exists()
