"""A job stopped by a signal at any moment saves where it stands and says how to continue;
the command it prints, run as printed, ends as if the job had never stopped: the same
weights, bit for bit, and the same test metrics. Real processes, real launchers (this
project's agent, torchrun), real signals."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import ROOT, start, subprocess_env, train

# Two epochs of eight steps, each step at least 0.4 s: a signal sent once the first
# epoch's checkpoint exists lands in the middle of the second epoch.
SLOW_STEPS = [
    "accelerator=cpu",
    "strategy=ddp",
    "data=digits",
    "data.batch_size=16",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
    "+callbacks.slow._target_=slurm_probe.StepProbe",
    "+callbacks.slow.step_s=0.4",
]
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2"]


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 400) -> None:
    deadline = time.time() + seconds
    while not path.is_file():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)


def _weights(job: Path) -> dict[str, torch.Tensor]:
    return torch.load(job / "model.pt", weights_only=True, map_location="cpu")


def assert_same_run(resumed: Path, uninterrupted: Path) -> None:
    a, b = _weights(resumed), _weights(uninterrupted)
    assert a.keys() == b.keys()
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{len(differing)} of {len(a)} tensors differ, e.g. {differing[:3]}"
    got, expected = (
        json.loads((job / "results.json").read_text()) for job in (resumed, uninterrupted)
    )
    tested = {k: v for k, v in expected.items() if k.startswith("test/")}
    assert tested and {k: got[k] for k in tested} == tested
    assert got["checkpoints"]["best"] == expected["checkpoints"]["best"].replace(
        str(uninterrupted), str(resumed)
    )
    assert got["global_step"] == expected["global_step"] == 16


def _run_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        shlex.split(command),
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ctrl_c_saves_and_the_printed_command_ends_as_if_never_stopped(tmp_path: Path) -> None:
    """Ctrl-C to `python train.py strategy=ddp devices=2`: every rank saves at the next step
    they agree on; the line printed continues in the same folder (`hydra.run.dir=<run>
    resume=true`), and the best-model record with it, so the test runs on the same best
    checkpoint as an uninterrupted run."""
    train(*SLOW_STEPS, "devices=2", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    script = [sys.executable, str(ROOT / "train.py")]
    proc = start(
        [*script, *SLOW_STEPS, "devices=2", "hydra.run.dir=run"], tmp_path, start_new_session=True
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    _wait_for(last, proc)
    first = last.stat().st_mtime_ns
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert last.stat().st_mtime_ns > first, "no checkpoint after the signal"
    step = torch.load(last, weights_only=True)["global_step"]
    assert 8 < step < 16, step
    (line,) = [x for x in err.splitlines() if x.startswith("error: stopped by SIGINT")]
    command = line.split("resume with: ", 1)[1]
    assert shlex.split(command)[-2:] == [f"hydra.run.dir={tmp_path / 'run'}", "resume=true"]
    _run_printed(command, tmp_path)
    assert_same_run(tmp_path / "run", tmp_path / "full")
    attempts = json.loads((tmp_path / "run" / "results.json").read_text())["attempts"]
    assert [(a["began"], a["start_step"]) for a in attempts] == [("fresh", 0), ("resume", step)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_to_torchrun_saves_within_the_grace_period_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """torchrun forwards SIGTERM to its workers and kills them 30 s later (Kubernetes
    evicts a pod the same way): every rank saves at the next agreed step, well within
    `callbacks.preemption.grace_period_s`; rank 0 prints the torchrun command that resumes,
    and running it gives the weights and test metrics of an uninterrupted run."""
    script = str(ROOT / "train.py")
    full = subprocess.run(
        [*TORCHRUN, script, *SLOW_STEPS, f"hydra.run.dir={tmp_path / 'full'}"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    proc = start([*TORCHRUN, script, *SLOW_STEPS, "hydra.run.dir=run"], tmp_path)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    _wait_for(last, proc)
    first = last.stat().st_mtime_ns
    time.sleep(1.0)
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert last.stat().st_mtime_ns > first, "no checkpoint after the signal"
    assert last.stat().st_mtime - signalled < 20, "saved after the grace period"
    step = torch.load(last, weights_only=True)["global_step"]
    assert 8 < step < 16, step
    (line,) = [x for x in err.splitlines() if x.startswith("Preempted (SIGTERM): saved")]
    assert f"saved {last} at step {step}" in line
    command = line.split("resume with: ", 1)[1]
    words = shlex.split(command)
    # torchrun's own command line, as its agent was started (its interpreter first).
    assert TORCHRUN[0] in words[:2] and "--nproc_per_node=2" in words
    assert words[-2:] == [f"hydra.run.dir={tmp_path / 'run'}", "resume=true"]
    _run_printed(command, tmp_path)
    assert_same_run(tmp_path / "run", tmp_path / "full")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_signal_during_validation_saves_the_last_training_step(tmp_path: Path) -> None:
    """SIGTERM while the first epoch validates (six batches of at least 1 s): every rank
    saves at a validation batch they agree on, a checkpoint of the last training step
    (step 8, the loops' counters and random numbers as they stood then); the resumed run
    validates that epoch again and ends as if it had never stopped."""
    slow_validation = [
        *[o for o in SLOW_STEPS if not o.startswith("trainer.limit_val_batches")],
        "trainer.limit_val_batches=6",
        "+callbacks.slow_val._target_=stop_probe.SlowValidation",
    ]
    train(*slow_validation, "devices=2", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    script = [sys.executable, str(ROOT / "train.py")]
    proc = start([*script, *slow_validation, "devices=2", "hydra.run.dir=run"], tmp_path)
    _wait_for(tmp_path / "run" / "validating_0", proc)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert not last.exists()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "during validation: as of the last training step" in out, out[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == 8
    (line,) = [x for x in err.splitlines() if x.startswith("error: stopped by SIGTERM")]
    resumed = _run_printed(line.split("resume with: ", 1)[1], tmp_path)
    # The interrupted validation ran again, whole, and its epoch ended (its line).
    assert re.search(r"epoch 1/2 .*val/acc", resumed.stdout), resumed.stdout[-3000:]
    assert_same_run(tmp_path / "run", tmp_path / "full")


def _stopped_and_resumed(proc: subprocess.Popen, tmp_path: Path, where: tuple[str, ...]) -> None:
    """SIGTERM has been sent: the job ends with 143, says where it stopped, leaves fit's
    last checkpoint (step 16) and no results, and its printed command ends as if it had
    never stopped."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert any(words in out + err for words in where), (out + err)[-3000:]
    job = tmp_path / "run"
    assert not (job / "results.json").exists()
    assert torch.load(job / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 16
    (line,) = [x for x in err.splitlines() if x.startswith("error: stopped by SIGTERM")]
    _run_printed(line.split("resume with: ", 1)[1], tmp_path)
    assert_same_run(job, tmp_path / "full")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_signal_in_the_last_steps_ends_fit_and_the_resume_tests(tmp_path: Path) -> None:
    """SIGTERM during the last training step, after the ranks' last agreement of a step has
    started: fit ends (the signal is decided when it ends, by one more all-reduce), test
    does not start, and the resumed run tests the finished fit."""
    train(*SLOW_STEPS, "devices=2", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    proc = start(
        [sys.executable, str(ROOT / "train.py"), *SLOW_STEPS, "devices=2", "hydra.run.dir=run"],
        tmp_path,
    )
    step = tmp_path / "run" / "step"
    deadline = time.time() + 400
    while not (step.is_file() and step.read_text().split()[0] == "15"):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    # Caught in the last step's agreement, at fit's end, or in the final validation's.
    _stopped_and_resumed(
        proc, tmp_path, ("after the last training step", "during validation", "batch 8")
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_signal_during_test_leaves_and_the_resume_tests_again(tmp_path: Path) -> None:
    """SIGTERM while the test runs (six batches of at least 1 s): fit's checkpoints are
    complete, every rank leaves at once, and the resumed run tests again from them."""
    slow_test = [
        *[o for o in SLOW_STEPS if not o.startswith("trainer.limit_test_batches")],
        "trainer.limit_test_batches=6",
        "+callbacks.slow_test._target_=stop_probe.SlowTest",
    ]
    train(*slow_test, "devices=2", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    proc = start(
        [sys.executable, str(ROOT / "train.py"), *slow_test, "devices=2", "hydra.run.dir=run"],
        tmp_path,
    )
    _wait_for(tmp_path / "run" / "testing", proc)
    proc.send_signal(signal.SIGTERM)
    _stopped_and_resumed(proc, tmp_path, ("during test",))
