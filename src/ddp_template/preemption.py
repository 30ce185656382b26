"""Signals that end a job: preemption and time limits on SLURM (save at the next step,
requeue, resume), and Ctrl-C or SIGTERM to a run started here (say how to resume).

SLURM announces the end of a job with a signal: the one submitit asks for with
`--signal=USR2@<signal_delay_s>` before the time limit (and that `scancel --signal=USR2`
sends to preempt a job), or SIGTERM when the scheduler itself requeues or cancels it. This
callback is the one owner of both signals while the job trains:

- the handler only notes the signal (a handler runs between two Python bytecodes of the
  main thread, maybe in the middle of a backward pass: no collective may start there);
- at the next step boundary the ranks agree whether any of them got one (one all-reduce of
  a flag per step), and all of them call `trainer.save_checkpoint(<job>/checkpoints/last.ckpt)`:
  a mid-epoch checkpoint holding every step done so far;
- for the preemption signal, rank 0 requeues the job (`scontrol requeue`); on SIGTERM the
  scheduler has already decided. Every rank then exits. The requeued job runs the same Hydra
  job in the same folder, and `train.py` resumes from `last.ckpt` (SLURM_RESTART_COUNT > 0).

submitit's own handler (rank 0 requeues and exits, nothing saved) and Lightning's SIGUSR1
requeue (`hpc_ckpt_<N>.ckpt`, saved inside the signal handler) are switched off meanwhile.

A run started on this machine (`python train.py strategy=ddp devices=2`) stops at Ctrl-C or
SIGTERM as PyTorch's elastic agent makes it (the workers get the signal, then SIGKILL); the
launching process then prints one line: where the last checkpoint is, and the command that
resumes from it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment

from ddp_template.new_task import interpreter_in

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ModelCheckpoint

# A rank's exit code after its preemption checkpoint, as for a process ended by SIGTERM. Not
# 0: torch's `record` would turn a SystemExit(0) into a normal return, and submitit would
# record a finished job.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(SystemExit):
    """Ends a worker after its preemption checkpoint. A SystemExit: submitit then records no
    result for the job (it runs again after the requeue) and Hydra no failed job."""


class PreemptionCheckpoint(L.Callback):
    """In a SLURM job: saves, requeues and exits at the preemption signal or SIGTERM. In a
    worker of an elastic agent: ends the process at once at Ctrl-C or SIGTERM."""

    def __init__(self, signal: str = "USR2", requeue: bool = True) -> None:
        self.signal = _signal_named(signal)
        self.requeue = requeue
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
        self._preemptible = False
        self._trainer: L.Trainer | None = None

    @staticmethod
    def active() -> bool:
        return "SLURM_JOB_ID" in os.environ and SLURMEnvironment.detect()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment):
            # One owner: Lightning's own requeue (SIGUSR1, hpc_ckpt) stays off.
            environment.auto_requeue = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its handlers (it does so once setup is done).
        self._received = None
        if self.active():
            for signum in (self.signal, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._note)
            self._preemptible = True
        elif "TORCHELASTIC_RUN_ID" in os.environ and trainer.world_size > 1:
            self._trainer = trainer
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._exit_now)

    def _exit_now(self, signum: int, frame: FrameType | None) -> None:
        """A worker of an elastic agent (this launcher's, or torchrun's) at Ctrl-C or
        SIGTERM: the other ranks are being stopped too, so a graceful shutdown would wait in
        collectives that never complete until the agent's SIGKILL, 30 s later. The loggers
        write what they hold; the process ends at once."""
        for logger in self._trainer.loggers if self._trainer else []:
            with contextlib.suppress(Exception):
                logger.finalize("interrupted")
        os._exit(128 + signum)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._received is None:
            self._received = signum

    def _disarm(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        self._preemptible = False
        self._trainer = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._disarm()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception) -> None:
        self._disarm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._preemptible or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        # 2: some rank got the preemption signal, 1: only SIGTERM, 0: nothing.
        levels: dict[int | None, int] = {None: 0, signal.SIGTERM: 1}
        mine = levels.get(self._received, 2)
        agreed = _max_over_ranks(trainer, mine)
        if agreed == 0:
            return
        self._received = self.signal if agreed == 2 else signal.SIGTERM
        # The job is ending: a SIGTERM from now on (scontrol requeue sends one) must not
        # interrupt the save.
        for signum in (self.signal, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        path = checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        message = (
            f"Preempted ({signal.Signals(self._received).name}): saved {path} at step "
            f"{trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx + 1})"
        )
        exit_code = PREEMPTED_EXIT_CODE
        if trainer.is_global_zero:
            if self.requeue and self._received == self.signal:
                requeued, outcome = requeue_job()
                message += f"; {outcome}"
                exit_code = PREEMPTED_EXIT_CODE if requeued else 1
            else:
                message += "; the scheduler ends the job"
            print(message, file=sys.stderr, flush=True)
        trainer.strategy.barrier("preemption")
        raise Preempted(exit_code)


def checkpoint_path(trainer: L.Trainer) -> Path:
    """`last.ckpt` beside the run's other checkpoints, where a resume looks for it."""
    # Lightning types it as the Checkpoint base class; the run's is a ModelCheckpoint.
    callback = cast("ModelCheckpoint | None", trainer.checkpoint_callback)
    folder = Path(callback.dirpath) if callback and callback.dirpath else None
    return (folder or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"


def _max_over_ranks(trainer: L.Trainer, value: int) -> int:
    tensor = torch.tensor(value, device=trainer.strategy.root_device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def requeue_job() -> tuple[bool, str]:
    """`scontrol requeue` of this job (an array task by its own id): done, and what happened."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = (
        f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        if array_job
        else os.environ["SLURM_JOB_ID"]
    )
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        return True, f"requeued SLURM job {job}; it resumes from this checkpoint"
    return False, (
        f"requeueing SLURM job {job} failed ({done.stderr.strip()}); resume by hand with "
        f"ckpt_path=<that file>"
    )


def _signal_named(name: str) -> signal.Signals:
    full = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[full]
    except KeyError:
        from ddp_template.errors import ConfigError

        raise ConfigError(
            "callbacks.preemption.signal", name, "a signal name such as USR2", "signal: USR2"
        ) from None


def interrupted_message(signum: int, checkpoint_dir: Path, overrides: list[str]) -> str:
    """One line for a run stopped by a signal: the last checkpoint and how to resume."""
    name = signal.Signals(signum).name
    last = checkpoint_dir / "last.ckpt"
    if not last.is_file():
        return f"stopped by {name} before the first checkpoint: nothing to resume from"
    kept = [o for o in overrides if not o.startswith(("ckpt_path=", "hydra.run.dir="))]
    command = shlex.join([*this_command(), *kept, f"ckpt_path={last}"])
    return f"stopped by {name}; the last checkpoint is {last}; resume with: {command}"


def interrupted_sweep_message(signum: int, sweep_dir: Path) -> str:
    """One line for a sweep stopped by a signal: the command that continues it in its
    folder (resume=true: finished jobs are kept, interrupted ones resume, docs/resume.md)."""
    kept = [a for a in sys.argv[1:] if not a.startswith(("hydra.sweep.dir=", "resume="))]
    command = shlex.join([*this_command(), *kept, f"hydra.sweep.dir={sweep_dir}", "resume=true"])
    return f"stopped by {signal.Signals(signum).name}; resume the sweep with: {command}"


def this_command() -> list[str]:
    """How this process was started, to be typed again from the same folder: the running
    interpreter (`.venv/bin/python` inside the project; a bare `python` may be another one,
    without the project) and the script as it was given."""
    script = sys.argv[0]
    if not script.endswith(".py"):
        return [script]  # an installed entry point runs its own interpreter
    return [interpreter_in(Path.cwd()), script]
