"""Signals that end a job: preemption and time limits on SLURM (save at the next step,
requeue, resume), and SIGTERM or Ctrl-C to a job of several ranks on any launcher (save at
the next step, say how to resume).

SLURM announces the end of a job with a signal: the one submitit asks for with
`--signal=USR2@<signal_delay_s>` before the time limit (and that `scancel --signal=USR2`
sends to preempt a job), or SIGTERM when the scheduler itself requeues or cancels it.
Elsewhere SIGTERM is the end: torchrun's agent forwards its SIGTERM (or Ctrl-C's SIGINT) to
the workers and kills them 30 s later, Kubernetes sends SIGTERM to an evicted pod and kills
it after its grace period (30 s by default), mpirun forwards SIGTERM to its processes. This
callback is the one owner of these signals while the job trains, on every launcher:

- the handler only notes the signal (a handler runs between two Python bytecodes of the
  main thread, maybe in the middle of a backward pass: no collective may start there);
- the ranks agree whether any of them got one without stopping the host: at every optimizer
  step each rank starts a non-blocking all-reduce (max) of its flag and reads the one it
  started `decide_after_steps` steps earlier, long since complete (`FlagAgreement`). Every
  rank reads the same result at the same step, so all of them stop together and call
  `trainer.save_checkpoint(<job>/checkpoints/last.ckpt)`: a mid-epoch checkpoint holding
  every step done so far. `decide_after_steps=0` reads each result at once, a host sync per
  step (on a GPU the host then waits for the device to drain its queue);
- a signal noted after the last training step (during the final validation) is acted on
  when fit ends: the fit's own last checkpoint is complete, test is not started, and the
  job ends as preempted, so that its resume runs the test;
- after SIGTERM or SIGINT the launcher kills the process soon: when no rank has begun the
  save within `grace_period_s` (a validation or a step longer than that), the process ends
  without one, before the kill, and the job's previous `last.ckpt` stays the newest;
- for the preemption signal, rank 0 requeues the job (`scontrol requeue`); on SIGTERM the
  scheduler has already decided. Every rank then exits. The requeued job runs the same Hydra
  job in the same folder, and `train.py` resumes from `last.ckpt` (SLURM_RESTART_COUNT > 0).
  Off SLURM, the line printed says how to resume: the same command plus
  `hydra.run.dir=<the job's folder> resume=true`.

submitit's own handler (rank 0 requeues and exits, nothing saved) and Lightning's SIGUSR1
requeue (`hpc_ckpt_<N>.ckpt`, saved inside the signal handler) are switched off meanwhile, and
so is the broadcast of rank 0's SIGTERM flag Lightning's loop makes before every step of a
job of several ranks (a host sync per step): that flag is set only by Lightning's SIGTERM
handler, replaced here.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment

from ddp_template.project import interpreter_in

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
    job of several ranks on any other launcher: saves and exits at SIGTERM or Ctrl-C."""

    def __init__(
        self,
        signal: str = "USR2",
        requeue: bool = True,
        decide_after_steps: int = 2,
        grace_period_s: float = 20.0,
    ) -> None:
        self.signal = _signal_named(signal)
        self.requeue = requeue
        self.decide_after_steps = _steps_named(decide_after_steps)
        self.grace_period_s = _grace_named(grace_period_s)
        self._agreement: FlagAgreement | None = None
        self._trainer_loop: Any = None
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
        self._grace: threading.Timer | None = None
        self._saving = False
        # What a checkpoint at the last training step would hold of what validation changes.
        self._before_validation: _TrainingState | None = None
        self._validation_batches = 0
        self._validation_shared = 0
        self._test_trainer: L.Trainer | None = None

    @staticmethod
    def active() -> bool:
        return "SLURM_JOB_ID" in os.environ and SLURMEnvironment.detect()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment):
            # One owner: Lightning's own requeue (SIGUSR1, hpc_ckpt) stays off.
            environment.auto_requeue = False

    def owned_signals(self, world_size: int) -> tuple[int, ...]:
        """The signals this callback answers while the job trains: SLURM's preemption
        signal and SIGTERM in a SLURM job; SIGTERM and SIGINT in any job of several ranks
        (torchrun, this project's agent, mpirun, Kubeflow, jsrun); none in one process,
        where Lightning's own SIGTERM handling costs no collective."""
        if self.active():
            return (self.signal, signal.SIGTERM)
        if world_size > 1:
            return (signal.SIGTERM, signal.SIGINT)
        return ()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its handlers (it does so once setup is done).
        self._received = None
        self._saving = False
        owned = self.owned_signals(trainer.world_size)
        for signum in owned:
            self._previous[signum] = signal.signal(signum, self._note)
        if owned:
            self._agreement = FlagAgreement(self.decide_after_steps, trainer.strategy.root_device)
            self._trainer_loop = _skip_lightnings_sigterm_broadcast(trainer)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._received is not None:
            return
        self._received = signum
        if signum in (signal.SIGTERM, signal.SIGINT):
            # The launcher kills the process soon: it must not be killed halfway through a
            # save, nor wait in a collective a stopped peer never joins.
            self._grace = threading.Timer(self.grace_period_s, self._out_of_grace, (signum,))
            self._grace.daemon = True
            self._grace.start()

    def _out_of_grace(self, signum: int) -> None:
        if self._saving:
            return
        print(
            f"{signal.Signals(signum).name}: no training step reached within "
            f"callbacks.preemption.grace_period_s={self.grace_period_s:g} s; ending without a "
            "new checkpoint (the job's last.ckpt, if any, is the newest)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    def _disarm(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._trainer_loop is not None:
            vars(self._trainer_loop).pop("_broadcast_sigterm_tensor", None)
            self._trainer_loop = None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self._agreement = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank started as many all-reduces: waiting for the last ones cannot hang, and
        # none is left in flight when the process group goes. A signal noted after the last
        # step (during the final validation) is decided here, by one more all-reduce.
        if self._agreement is not None:
            pending = self._agreement.drain()
            agreed = max(pending, self._agreement.now(self._level()))
            if agreed:
                self._stop(trainer, agreed, where="after the last training step")
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

    def _level(self) -> int:
        """2: the preemption signal (requeue), 1: SIGTERM or SIGINT (stop), 0: nothing."""
        if self._received is None:
            return 0
        return 2 if self._received == self.signal and self.active() else 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._agreement is None:
            return
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            agreed = self._agreement.step(self._level())
            if agreed:
                # Nothing left in flight while the ranks save and exit.
                agreed = max(agreed, self._agreement.drain())
                where = f"epoch {trainer.current_epoch}, batch {batch_idx + 1}"
                self._stop(trainer, agreed, where)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreement is None or trainer.sanity_checking:
            return
        # Evaluation shards are not padded: ranks may run different numbers of batches. The
        # ranks agree during the batches every rank runs (one all-reduce per validation).
        self._validation_batches = 0
        self._validation_shared = _fewest_on_any_rank(trainer)
        self._before_validation = _TrainingState.of(trainer)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if self._agreement is None or trainer.sanity_checking or self._before_validation is None:
            return
        self._validation_batches += 1
        if self._validation_batches > self._validation_shared:
            return
        agreed = self._agreement.step(self._level())
        if agreed:
            agreed = max(agreed, self._agreement.drain())
            where = "during validation: as of the last training step"
            self._stop(trainer, agreed, where, self._before_validation)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._before_validation = None

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After fit, its checkpoints are complete: a signal during test leaves at once (each
        rank itself, no collective), and the resume runs the test again."""
        for signum in self.owned_signals(trainer.world_size):
            self._previous[signum] = signal.signal(signum, self._leave_during_test)
        self._test_trainer = trainer

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._disarm()

    def _leave_during_test(self, signum: int, frame: FrameType | None) -> None:
        trainer = self._test_trainer
        assert trainer is not None  # set before the handler is
        path = checkpoint_path(trainer)
        name = signal.Signals(signum).name
        exit_code = 128 + signum
        if trainer.is_global_zero:
            message = f"Preempted ({name}) during test: the fit's checkpoints are complete"
            stream = sys.stderr
            if not self.active():
                message += f"; {stopped_here_note(Path(trainer.default_root_dir))}"
                # Under this project's agent rank 0's stdout reaches the console.
                stream = sys.stdout if _in_own_worker() else sys.stderr
            elif self.requeue and signum == self.signal:
                requeued, outcome = requeue_job(path)
                message += f"; {outcome}"
                exit_code = PREEMPTED_EXIT_CODE if requeued else 1
            print(message, file=stream, flush=True)
        os._exit(exit_code)

    def _stop(
        self,
        trainer: L.Trainer,
        agreed: int,
        where: str,
        before_validation: _TrainingState | None = None,
    ) -> None:
        """Every rank together: saves `last.ckpt`, requeues (rank 0, for the preemption
        signal) or says how to resume, and ends the process. During validation the
        checkpoint is the state as that validation began: validation changes no weight,
        optimizer or scheduler state, only the loops' counters and the random numbers,
        which are saved as they stood then; the resumed run runs that validation again."""
        if agreed == 2:
            self._received = self.signal
        elif self._received not in (signal.SIGTERM, signal.SIGINT):
            self._received = signal.SIGTERM  # another rank's
        # The job is ending: a SIGTERM from now on (scontrol requeue sends one) must not
        # interrupt the save, nor the grace period's end.
        self._saving = True
        for signum in {self.signal, signal.SIGTERM, signal.SIGINT}:
            signal.signal(signum, signal.SIG_IGN)
        path = checkpoint_path(trainer)
        if before_validation is None:
            trainer.save_checkpoint(path)
        else:
            before_validation.save(trainer, path)
        name = signal.Signals(self._received).name
        message = f"Preempted ({name}): saved {path} at step {trainer.global_step} ({where})"
        exit_code = PREEMPTED_EXIT_CODE
        stream = sys.stderr
        if trainer.is_global_zero:
            if not self.active():
                message += f"; {stopped_here_note(Path(trainer.default_root_dir))}"
                # Under this project's agent rank 0's stdout is the one that reaches the
                # console.
                stream = sys.stdout if _in_own_worker() else sys.stderr
            elif self.requeue and agreed == 2:
                requeued, outcome = requeue_job(path)
                message += f"; {outcome}"
                exit_code = PREEMPTED_EXIT_CODE if requeued else 1
            else:
                message += "; the scheduler ends the job"
            print(message, file=stream, flush=True)
        trainer.strategy.barrier("preemption")
        raise Preempted(exit_code)


class _TrainingState:
    """The loops' state (their counters and the training loader's position) and this rank's
    random-number states as a validation inside fit starts, its first batch marked begun:
    a checkpoint of them resumes into that validation (Lightning's "restarted mid
    evaluation"), runs it whole, then the rest of the training step (the step's scheduler
    update, its epoch's end when it is the last).

    Taken at the training batch's end instead, Lightning would read the checkpoint of the
    epoch's last batch as a finished epoch and skip its validation and its end: no
    checkpoint of that epoch's model, and after the last epoch no validation at all."""

    def __init__(self, loops: dict[str, Any], rng: dict[str, Any]) -> None:
        self.loops = loops
        self.rng = rng

    @classmethod
    def of(cls, trainer: L.Trainer) -> _TrainingState:
        from lightning.fabric.utilities.seed import _collect_rng_states

        on_cuda = trainer.strategy.root_device.type == "cuda"
        loops = copy.deepcopy(trainer._checkpoint_connector._get_loops_state_dict())
        _mark_first_batch_begun(loops["fit_loop"]["epoch_loop.val_loop.batch_progress"])
        return cls(loops, _collect_rng_states(include_cuda=on_cuda))

    def save(self, trainer: L.Trainer, path: Path) -> None:
        """As `trainer.save_checkpoint(path)` then (on every rank): the process ends after
        it, so its generators may be put back first, for the checkpoint to hold."""
        from lightning.fabric.utilities.seed import _set_rng_states

        _set_rng_states(self.rng)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint["loops"] = self.loops
        trainer.strategy.save_checkpoint(checkpoint, path)
        trainer.strategy.barrier("Trainer.save_checkpoint")


def _mark_first_batch_begun(progress: dict[str, Any]) -> None:
    """A validation's batch progress as Lightning leaves it when a run stops inside the
    first batch: ready and started, not processed (its `RESTARTED_MID_EVALUATION`)."""
    for counts in (progress["total"], progress["current"]):
        counts["ready"] = counts["started"] = counts["completed"] + 1
        counts["processed"] = counts["completed"]
    progress["is_last_batch"] = False


def _fewest_on_any_rank(trainer: L.Trainer) -> int:
    """The fewest validation batches any rank runs in this validation."""
    batches = sum(trainer.num_val_batches)
    mine = int(batches) if batches != float("inf") else 2**31 - 1
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    count = torch.full((1,), mine, dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count[0])


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

    def now(self, flag: int) -> int:
        """The largest of every rank's flag at once: a blocking all-reduce, for a point
        every rank reaches once (the end of fit), not for every step."""
        distributed = dist.is_available() and dist.is_initialized()
        return _Reduction(flag, self.device).result() if distributed else flag

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


def _grace_named(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    from ddp_template.errors import ConfigError

    raise ConfigError(
        "callbacks.preemption.grace_period_s",
        value,
        "seconds > 0, below the launcher's wait before it kills the process (torchrun: 30 s,"
        " Kubernetes: terminationGracePeriodSeconds, 30 s by default)",
        "callbacks.preemption.grace_period_s=20",
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
    """The command that continues this job's sweep in its folder, for a SLURM job whose
    requeue failed (`resume=true`: finished jobs are kept, this one resumes from its
    `last.ckpt` in its own folder, docs/resume.md). In a SLURM job `sys.argv` is
    submitit's, so the command is rebuilt from Hydra's record of the sweep (its folder, the
    sweep's overrides in `multirun.yaml`) and the project's `train.py`."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from ddp_template.project import CONFIG_DIR
    from ddp_template.resume.folder import SWEEP_CONFIG

    hydra = HydraConfig.get()
    folder = Path(hydra.runtime.cwd)
    script = Path(CONFIG_DIR).parent / "train.py"
    with contextlib.suppress(ValueError):
        script = script.relative_to(folder)
    sweep_dir = Path(hydra.sweep.dir)
    if not sweep_dir.is_absolute():
        sweep_dir = folder / sweep_dir
    overrides = list(hydra.overrides.task)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        overrides = list(OmegaConf.load(sweep_dir / SWEEP_CONFIG).hydra.overrides.task)
    kept = [o for o in overrides if o.lstrip("+~").split("=")[0] not in _REPLACED]
    words = [interpreter_in(folder), str(script), "-m", *kept]
    words += [f"hydra.sweep.dir={sweep_dir}", "resume=true"]
    return f"cd {shlex.quote(str(folder))} && {shlex.join(words)}"


# Overrides a continued run replaces: its folder and the switch that continues in it.
_REPLACED = ("hydra.run.dir", "hydra.sweep.dir", "resume")


def continued_in(overrides: list[str], run_dir: Path) -> list[str]:
    """The run's overrides, plus what continues it in `run_dir` exactly as if it had never
    stopped: the same folder (its best-model record, attempts and logs go on there; a new
    folder with ckpt_path= would start a new best-model record) and `resume=true`."""
    kept = [o for o in overrides if o.lstrip("+~").split("=")[0] not in _REPLACED]
    return [*kept, f"hydra.run.dir={run_dir}", "resume=true"]


def stopped_here_note(run_dir: Path) -> str:
    """What rank 0 adds to its line after saving at SIGTERM or Ctrl-C off SLURM."""
    if _in_own_worker():
        return "the launching process prints how to resume"
    return f"resume with: {external_resume_command(run_dir)}"


def _in_own_worker() -> bool:
    from ddp_template.launch.agent import in_own_worker

    return in_own_worker()


def external_resume_command(run_dir: Path) -> str:
    """The command that continues a job whose processes an external launcher started:
    torchrun's own command line (the agent is this process's parent), with this job's
    overrides replaced; for mpirun, srun, Kubeflow or jsrun, each process's command, to be
    started by the same launcher as before."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    script_and_args = [sys.argv[0], *continued_in(overrides, run_dir)]
    agent = _torchrun_command()
    if agent is not None:
        return shlex.join([*agent, *script_and_args])
    return "the same launcher as before, each process: " + shlex.join(
        [*this_command()[:-1], *script_and_args]
    )


def _torchrun_command() -> list[str] | None:
    """torchrun's words before the training script, read from the agent's command line."""
    from ddp_template.launch.world import started_by

    if started_by() != "torchrun":
        return None
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    if sys.argv[0] not in words:
        return None
    return words[: words.index(sys.argv[0])]


def _signal_named(name: str) -> signal.Signals:
    full = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[full]
    except KeyError:
        from ddp_template.errors import ConfigError

        raise ConfigError(
            "callbacks.preemption.signal", name, "a signal name such as USR2", "signal: USR2"
        ) from None


def interrupted_message(signum: int, run_dir: Path, overrides: list[str]) -> str:
    """One line for a run stopped by a signal: its last checkpoint, and the command that
    continues it as if it had never stopped (the same command, in the same folder)."""
    from ddp_template.resume.folder import last_checkpoint_of

    name = signal.Signals(signum).name
    last = last_checkpoint_of(run_dir)
    if not last.is_file():
        return f"stopped by {name} before the first checkpoint: nothing to resume from"
    command = shlex.join([*this_command(), *continued_in(overrides, run_dir)])
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
