"""Signals that end a job: preemption and time limits on SLURM (save at the next step,
requeue, resume), and Ctrl-C or SIGTERM to a run started here (say how to resume).

SLURM announces the end of a job with a signal: the one submitit asks for with
`--signal=USR2@<signal_delay_s>` before the time limit (and that `scancel --signal=USR2`
sends to preempt a job), or SIGTERM when the scheduler itself requeues or cancels it. This
callback is the one owner of both signals while the job trains:

- the handler only notes the signal (a handler runs between two Python bytecodes of the
  main thread, maybe in the middle of a backward pass: no collective may start there);
- the ranks agree whether any of them got one without stopping the host: at every optimizer
  step each rank starts a non-blocking all-reduce (max) of its flag and reads the one it
  started `decide_after_steps` steps earlier, long since complete (`FlagAgreement`). Every
  rank reads the same result at the same step, so all of them stop together and call
  `trainer.save_checkpoint(<job>/checkpoints/last.ckpt)`: a mid-epoch checkpoint holding
  every step done so far. `decide_after_steps=0` reads each result at once, a host sync per
  step (on a GPU the host then waits for the device to drain its queue);
- for the preemption signal, rank 0 requeues the job (`scontrol requeue`); on SIGTERM the
  scheduler has already decided. Every rank then exits. The requeued job runs the same Hydra
  job in the same folder, and `train.py` resumes from `last.ckpt` (SLURM_RESTART_COUNT > 0).

submitit's own handler (rank 0 requeues and exits, nothing saved) and Lightning's SIGUSR1
requeue (`hpc_ckpt_<N>.ckpt`, saved inside the signal handler) are switched off meanwhile, and
so is the broadcast of rank 0's SIGTERM flag Lightning's loop makes before every step (a host
sync per step): that flag is set only by Lightning's SIGTERM handler, replaced here.

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
from collections import deque
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

    def __init__(
        self, signal: str = "USR2", requeue: bool = True, decide_after_steps: int = 2
    ) -> None:
        self.signal = _signal_named(signal)
        self.requeue = requeue
        self.decide_after_steps = _steps_named(decide_after_steps)
        self._agreement: FlagAgreement | None = None
        self._trainer_loop: Any = None
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
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
            self._agreement = FlagAgreement(self.decide_after_steps, trainer.strategy.root_device)
        elif "TORCHELASTIC_RUN_ID" in os.environ and trainer.world_size > 1:
            self._trainer = trainer
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._exit_now)
        if signal.SIGTERM in self._previous:
            self._trainer_loop = _skip_lightnings_sigterm_broadcast(trainer)

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
        if self._trainer_loop is not None:
            vars(self._trainer_loop).pop("_broadcast_sigterm_tensor", None)
            self._trainer_loop = None
        self._trainer = None
        self._agreement = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank started as many all-reduces: waiting for the last ones cannot hang, and
        # none is left in flight when the process group goes.
        if self._agreement is not None:
            self._agreement.drain()
        self._disarm()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception) -> None:
        # A peer may be gone: pending all-reduces are dropped, not waited for.
        if isinstance(exception, Preempted):
            # The process is ending and the requeue's SIGTERM is on its way: it stays
            # ignored. Restored, Lightning's handler would broadcast inside the handler, to a
            # rank already gone (gloo: "Connection closed by peer"), and this rank would
            # record that error as the job's result, which the sweep reads as a failure.
            self._previous = {}
        self._disarm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._agreement is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        # 2: some rank got the preemption signal, 1: only SIGTERM, 0: nothing.
        levels: dict[int | None, int] = {None: 0, signal.SIGTERM: 1}
        agreed = self._agreement.step(levels.get(self._received, 2))
        if agreed == 0:
            return
        # Nothing left in flight while the ranks save and exit.
        agreed = max(agreed, self._agreement.drain())
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
                requeued, outcome = requeue_job(path)
                message += f"; {outcome}"
                exit_code = PREEMPTED_EXIT_CODE if requeued else 1
            else:
                message += "; the scheduler ends the job"
            print(message, file=sys.stderr, flush=True)
        trainer.strategy.barrier("preemption")
        raise Preempted(exit_code)


def _skip_lightnings_sigterm_broadcast(trainer: L.Trainer) -> Any:
    """Lightning's training loop broadcasts rank 0's SIGTERM flag and reads it (`.item()`)
    before every step of a run of several ranks: a host sync per step. Its flag is set only
    by Lightning's SIGTERM handler, which this callback replaces while it owns SIGTERM, so
    the broadcast would only ever carry a 0. Returns the loop it was switched off in."""
    loop = trainer.fit_loop.epoch_loop
    if getattr(trainer, "received_sigterm", False) or not hasattr(
        loop, "_broadcast_sigterm_tensor"
    ):
        return None
    loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]
    return loop


def checkpoint_path(trainer: L.Trainer) -> Path:
    """`last.ckpt` beside the run's other checkpoints, where a resume looks for it."""
    # Lightning types it as the Checkpoint base class; the run's is a ModelCheckpoint.
    callback = cast("ModelCheckpoint | None", trainer.checkpoint_callback)
    folder = Path(callback.dirpath) if callback and callback.dirpath else None
    return (folder or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"


class _Reduction:
    """One all-reduce (max) in flight, and how to read its result without draining the
    device's queue: on a GPU a copy into pinned host memory behind it, and an event."""

    def __init__(self, value: int, device: torch.device) -> None:
        # torch.full, not torch.tensor: a copy from pageable host memory would sync the host.
        self.tensor = torch.full((1,), value, dtype=torch.int32, device=device)
        self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, async_op=True)
        self.event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self.work.wait()  # the current stream waits for the collective; the host does not
            self.host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self.host.copy_(self.tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> int:
        if self.event is not None:
            self.event.synchronize()  # long since reached: the queue behind it is not waited for
            return int(self.host[0])
        self.work.wait()
        return int(self.tensor[0])


class FlagAgreement:
    """The largest of every rank's flag, decided together without a host sync per step.

    `step(flag)` at every optimizer step starts a non-blocking all-reduce of this rank's
    flag and returns the result of the one started `lag` steps earlier (0 until there is
    one). Every rank calls it at the same steps, so every rank reads the same result at the
    same step: the decision is collective and deterministic. A lag of 0 reads at once."""

    def __init__(self, lag: int, device: torch.device) -> None:
        self.lag = lag
        self.device = device
        self._pending: deque[_Reduction | int] = deque()

    def step(self, flag: int) -> int:
        distributed = dist.is_available() and dist.is_initialized()
        self._pending.append(_Reduction(flag, self.device) if distributed else flag)
        if len(self._pending) <= self.lag:
            return 0
        return _read(self._pending.popleft())

    def drain(self) -> int:
        """Waits for every all-reduce in flight; the largest of their results."""
        results = [_read(pending) for pending in self._pending]
        self._pending.clear()
        return max(results, default=0)


def _read(pending: _Reduction | int) -> int:
    return pending if isinstance(pending, int) else pending.result()


def _steps_named(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    from ddp_template.errors import ConfigError

    raise ConfigError(
        "callbacks.preemption.decide_after_steps",
        value,
        "a whole number of steps >= 0 (0: every rank waits for the others at every step)",
        "callbacks.preemption.decide_after_steps=2",
    )


def requeue_job(path: Path) -> tuple[bool, str]:
    """`scontrol requeue` of this job (an array task by its own id): done, and what happened
    (on failure, the command that resumes from `path`)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = (
        f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        if array_job
        else os.environ["SLURM_JOB_ID"]
    )
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        return True, f"requeued SLURM job {job}; it resumes from this checkpoint"
    why = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
    return False, f"requeueing SLURM job {job} failed ({why}); resume with: {resume_command(path)}"


def resume_command(checkpoint: Path) -> str:
    """The sweep command of this Hydra job again, from `checkpoint`: in a SLURM job
    `sys.argv` is submitit's, so the command is rebuilt from Hydra's record of the launch
    (its folder, the job's overrides) and the project's `train.py`."""
    from hydra.core.hydra_config import HydraConfig

    from ddp_template.config import CONFIG_DIR

    hydra = HydraConfig.get()
    folder = Path(hydra.runtime.cwd)
    script = Path(CONFIG_DIR).parent / "train.py"
    with contextlib.suppress(ValueError):
        script = script.relative_to(folder)
    # A new sweep folder: the resumed run must not write over this one's jobs.
    dropped = ("ckpt_path", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.run.dir")
    kept = [o for o in hydra.overrides.task if o.lstrip("+~").split("=")[0] not in dropped]
    words = [interpreter_in(folder), str(script), "-m", *kept, f"ckpt_path={checkpoint}"]
    return f"cd {shlex.quote(str(folder))} && {shlex.join(words)}"


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
