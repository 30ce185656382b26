"""Training progress on rank 0: Lightning's rich progress bar on a terminal, plain lines at a
regular interval anywhere else (a SLURM log, a file, a pipe, rank 0's stream under the
launcher), where a live bar would print nothing until the epoch ends."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.utilities.data import extract_batch_size
from omegaconf import DictConfig

from ddp_template.callbacks.speed import SpeedMonitor
from ddp_template.errors import ConfigError
from ddp_template.worker.results import tflops_text


def progress_reporter(
    every_n_steps: int | None = None, every_s: float | None = 30.0
) -> ProgressBar:
    """The bar when rank 0's stdout is a terminal, else `ProgressLines`."""
    if on_terminal():
        return RichProgressBar()
    return ProgressLines(every_n_steps=every_n_steps, every_s=every_s)


def on_terminal() -> bool:
    """Whether this rank draws a live bar. The same answer on every rank: the bar reduces
    metrics over ranks as it draws, so ranks that differ would wait in different
    collectives. Ranks started by mpirun, srun, jsrun or a PyTorchJob each get their own
    kind of stream (mpirun gave rank 0 a terminal and not the others), so they print lines."""
    from ddp_template.launch.world import started_by

    return sys.stdout.isatty() and started_by() in (None, "torchrun")


def check_progress(cfg: DictConfig) -> None:
    """callbacks.progress: each interval null or > 0 (0 would print at every step)."""
    progress = (cfg.get("callbacks") or {}).get("progress")
    if not progress:
        return
    steps, seconds = progress.get("every_n_steps"), progress.get("every_s")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(
            "callbacks.progress.every_n_steps",
            steps,
            "a whole number of training steps >= 1, or null (lines by time only)",
            "e.g. callbacks.progress.every_n_steps=100",
        )
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0
    ):
        raise ConfigError(
            "callbacks.progress.every_s",
            seconds,
            "seconds > 0, or null (lines by steps only)",
            "e.g. callbacks.progress.every_s=30",
        )


def draws_live_bar(trainer: L.Trainer) -> bool:
    """Whether a bar redraws itself on the console (then per-epoch lines would be noise)."""
    bar = trainer.progress_bar_callback
    return bar is not None and not isinstance(bar, ProgressLines)


class ProgressLines(ProgressBar):
    """One line every `every_n_steps` training steps or every `every_s` seconds, whichever
    comes first (either may be null), e.g.

        epoch 2/10  step 120/469 (26%)  loss 0.4312  1,234 samples/s  41.2 TFLOP/s per device
        MFU 13.2%  left: epoch 0:42, run 7:31   (one line)

    The loss is rank 0's mean since the previous line; samples/s counts every rank's samples
    (rank 0's batches x world size); TFLOP/s and MFU follow from it and the FLOPs per sample
    SpeedMonitor counted (MFU only on GPUs whose peak is known); the time left extrapolates
    the training steps since the previous line (validation not included). The loss is summed on the device and read once
    per line, so the steps in between do not wait for the GPU.
    """

    def __init__(self, every_n_steps: int | None = None, every_s: float | None = 30.0) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self.every_s = every_s
        self._enabled = True
        self._epoch_total: float = math.inf
        self._reset_window(time.monotonic())

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs, flush=True)

    def _reset_window(self, now: float) -> None:
        self._window_start = now
        self._window_steps = 0
        self._window_samples = 0
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Read once: under a step limit Lightning's count shrinks as the steps go.
        self._epoch_total = self.total_train_batches
        self._reset_window(time.monotonic())

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._enabled:
            return
        self._window_steps += 1
        self._window_samples += extract_batch_size(batch)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss_sum = self._loss_sum + loss.detach()
            self._loss_count += 1
        now = time.monotonic()
        steps_due = self.every_n_steps and self._window_steps >= self.every_n_steps
        time_due = self.every_s is not None and now - self._window_start >= self.every_s
        if steps_due or time_due:
            self.print(self._line(trainer, batch_idx, now))
            self._reset_window(now)

    def _line(self, trainer: L.Trainer, batch_idx: int, now: float) -> str:
        elapsed = max(now - self._window_start, 1e-9)
        total = self._epoch_total
        done = batch_idx + 1
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        parts = [f"epoch {trainer.current_epoch + 1}{epochs}"]
        if math.isfinite(total) and total > 0:
            parts.append(f"step {done}/{int(total)} ({100 * done / total:.0f}%)")
        else:
            parts.append(f"step {done}")
        if self._loss_count:
            parts.append(f"loss {float(self._loss_sum) / self._loss_count:.4g}")
        rate = self._window_samples * trainer.world_size / elapsed
        parts.append(f"{rate:,.0f} samples/s")
        # Lightning declares Trainer.callbacks on a mixin its stubs do not show.
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        speed = next((c for c in callbacks if isinstance(c, SpeedMonitor)), None)
        flops = speed.flops_metrics(rate, trainer.world_size) if speed is not None else {}
        if "perf/tflops_per_sec_per_device" in flops:
            per_device = tflops_text(flops["perf/tflops_per_sec_per_device"])
            parts.append(f"{per_device} TFLOP/s per device")
        if "perf/mfu" in flops:
            parts.append(f"MFU {flops['perf/mfu']:.1%}")
        step_time = elapsed / self._window_steps
        left = _steps_left(trainer, done, total)
        if left is not None:
            epoch_left, run_left = left
            parts.append(
                f"left: epoch {_clock(epoch_left * step_time)}, run {_clock(run_left * step_time)}"
            )
        return "  ".join(parts)


def _steps_left(trainer: L.Trainer, done: int, total: float) -> tuple[float, float] | None:
    """Training batches left in this epoch and in the whole run (the sooner of the epoch
    and the step limits)."""
    if not math.isfinite(total):
        return None
    epoch_left = total - done
    limits = []
    if trainer.max_epochs and trainer.max_epochs > 0:
        limits.append(epoch_left + (trainer.max_epochs - trainer.current_epoch - 1) * total)
    if trainer.max_steps and trainer.max_steps > 0:
        optimizer_steps_left = trainer.max_steps - trainer.global_step
        limits.append(optimizer_steps_left * trainer.accumulate_grad_batches)
    run_left = min(limits) if limits else epoch_left
    return min(epoch_left, run_left), run_left


def _clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
