"""Training throughput, step time, data-loader wait and peak memory, measured the same way
for every run."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import extract_batch_size

from ddp_template.worker.comm_clock import blocked_s, ddp_exposed_s
from ddp_template.worker.flops import TERA, device_peak_tflops, training_flops_per_sample
from ddp_template.worker.memory import peak_memory_mb, peak_reserved_mb, reset_peak_memory
from ddp_template.worker.over_ranks import spread


class SpeedMonitor(L.Callback):
    """Times every training step, from the end of the previous step to the end of this one,
    and splits it into the wait for the next batch (end of the previous step to the start of
    this one: the loader, and the loop between steps) and the step itself.

    Not timed: the first `warmup_batches` steps of the fit (allocations, autotuning, worker
    start-up) and the first step of each epoch (its wait holds validation, checkpoints and
    the loader's restart). Logged at the end of each training epoch, over every timed step
    of the fit so far:

    - `perf/samples_per_sec`: samples of all ranks / time of the slowest rank;
    - `perf/samples_per_sec_per_device`;
    - `perf/step_time_median_s`, `perf/step_time_p90_s` (the slowest rank's);
    - `perf/data_wait_fraction` (largest over ranks) and its spread over ranks;
    - `perf/slowest_rank`: the rank whose timed steps took longest (the one the others wait
      for), and `perf/step_time_s/{min,median,max}` over ranks of each rank's median step;
    - `perf/exposed_comm_s`: what communication added to a step, the median over ranks
      (and its spread): under `fsdp` on CPUs the median over the timed steps of the seconds
      the training thread waited in FSDP's collectives, under `ddp` DDP's own timers
      (`worker/comm_clock.py`); not logged where neither applies (one process, fsdp on GPUs);
    - `perf/cpu_s_per_step/{min,median,max,...}`: over ranks, each rank's median CPU time
      per timed step (every thread of its process, the kernel's work for them included: the
      backward, the loop, the collectives' copies; not the loader's worker processes). Set
      against the step time it says how busy a rank's cores were: a rank under a CPU quota
      that computes and communicates on the same cores is bound by this sum, not by its link;
    - `perf/measured_steps`: steps timed;
    - `perf/warmup_time_s`: wall time of the untimed warm-up steps (the slowest rank's): with
      `compile=true` it holds the compilation, kept out of the step times;
    - `perf/peak_mem_mb/...`: the spread over ranks of each rank's peak memory since the fit
      started;
    - `perf/peak_reserved_mb/...` (CUDA): the same for the allocator's peak reservation;
    - `perf/flops_per_sample`: FLOPs of a training step's forward and backward per sample,
      counted once on the first batch (`flops.training_flops_per_sample`);
    - `perf/tflops_per_sec` and `perf/tflops_per_sec_per_device`: achieved, from those
      FLOPs and the samples/s above;
    - `perf/mfu`: the achieved share of the device's dense peak for the run's precision
      (`flops.PEAK_TFLOPS`), where the device is in the table (never on CPUs).

    A figure every rank has is logged as its spread, five keys whatever the world size
    (`<name>/min`, `/median`, `/max`, `/min_rank`, `/max_rank`), never one key per rank: a
    tracker would otherwise get thousands of series from a job of a thousand ranks. The
    ranks' rows are summed into one tensor by one all-reduce per epoch.

    Values are logged as metrics, so they also reach the main process under ddp_spawn.
    On CUDA, `sync_each_step` waits for the GPU at the end of each step: without it, the
    time of queued kernels lands in whichever step synchronises next.
    """

    def __init__(self, warmup_batches: int = 2, sync_each_step: bool = False) -> None:
        self.warmup_batches = warmup_batches
        self.sync_each_step = sync_each_step
        self.flops_per_sample: float | None = None
        self.peak_tflops: float | None = None
        self._flops_counted = False
        self._reset()

    def _reset(self) -> None:
        self._steps_seen = 0
        self._first_start: float | None = None
        self._warmup_time = 0.0
        self._previous_end: float | None = None
        self._previous_cpu = 0.0
        self._batch_start = 0.0
        self._batch_samples = 0
        self._samples = 0
        self._periods: list[float] = []
        self._waits: list[float] = []
        self._blocked_at_start = 0.0
        self._blocked: list[float] = []
        self._cpu: list[float] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        reset_peak_memory(pl_module.device)
        self.flops_per_sample = None
        self._flops_counted = False
        self.peak_tflops = device_peak_tflops(pl_module.device, str(trainer.precision), pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._previous_end = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()
        self._blocked_at_start = blocked_s()
        if self._first_start is None:
            self._first_start = self._batch_start
        self._batch_samples = extract_batch_size(batch)
        if not self._flops_counted:
            self._flops_counted = True
            model = getattr(pl_module, "model", None)
            if isinstance(model, torch.nn.Module):
                self.flops_per_sample = training_flops_per_sample(model, batch)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.sync_each_step:
            _synchronize(pl_module.device)
        end = time.perf_counter()
        cpu = time.process_time()
        if self._steps_seen >= self.warmup_batches and self._previous_end is not None:
            self._periods.append(end - self._previous_end)
            self._cpu.append(cpu - self._previous_cpu)
            self._waits.append(self._batch_start - self._previous_end)
            self._blocked.append(blocked_s() - self._blocked_at_start)
            self._samples += self._batch_samples
        self._previous_end = end
        self._previous_cpu = cpu
        self._steps_seen += 1
        if self._steps_seen == self.warmup_batches:
            assert self._first_start is not None  # set by on_train_batch_start
            self._warmup_time = end - self._first_start

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        elapsed = float(sum(self._periods))
        periods = self._periods or [0.0]
        mine = [
            float(self._samples),
            elapsed,
            float(np.median(periods)),
            float(np.percentile(periods, 90)),
            float(sum(self._waits)) / elapsed if elapsed > 0 else 0.0,
            peak_memory_mb(device),
            peak_reserved_mb(device) or 0.0,
            self._warmup_time,
            _exposed_comm_s(trainer.strategy.model, self._blocked),
            float(np.median(self._cpu)) if self._cpu else -1.0,
        ]
        # Every rank takes part in this collective, whether it timed any step or not.
        ranks = _gather_rows(mine, device)
        samples = sum(row[0] for row in ranks)
        slowest = max(row[1] for row in ranks)
        metrics = spread("perf/peak_mem_mb", [row[5] for row in ranks])
        if device.type == "cuda":
            metrics.update(spread("perf/peak_reserved_mb", [row[6] for row in ranks]))
        if slowest > 0:
            rate = samples / slowest
            metrics.update(
                {
                    "perf/samples_per_sec": rate,
                    "perf/samples_per_sec_per_device": rate / len(ranks),
                    "perf/step_time_median_s": max(row[2] for row in ranks),
                    "perf/step_time_p90_s": max(row[3] for row in ranks),
                    "perf/data_wait_fraction": max(row[4] for row in ranks),
                    "perf/slowest_rank": float(max(range(len(ranks)), key=lambda r: ranks[r][1])),
                    **spread("perf/data_wait_fraction", [row[4] for row in ranks]),
                    **spread("perf/step_time_s", [row[2] for row in ranks]),
                }
            )
            metrics.update(self.flops_metrics(rate, len(ranks)))
        exposed = [row[8] for row in ranks]
        if len(ranks) > 1 and min(exposed) >= 0:
            metrics["perf/exposed_comm_s"] = float(np.median(exposed))
            metrics.update(spread("perf/exposed_comm_s", exposed))
        cpu = [row[9] for row in ranks]
        if min(cpu) >= 0:
            metrics.update(spread("perf/cpu_s_per_step", cpu))
        metrics["perf/measured_steps"] = float(len(self._periods))
        metrics["perf/warmup_time_s"] = max(row[7] for row in ranks)
        metrics["perf/warmup_steps"] = float(min(self.warmup_batches, self._steps_seen))
        # Already reduced over ranks: every rank logs the same value.
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False)

    def flops_metrics(self, samples_per_sec: float, devices: int) -> dict[str, float]:
        """Achieved TFLOP/s (and MFU, where the peak is known) at a rate of samples/s."""
        if not self.flops_per_sample:
            return {}
        achieved = samples_per_sec * self.flops_per_sample / TERA
        metrics = {
            "perf/flops_per_sample": self.flops_per_sample,
            "perf/tflops_per_sec": achieved,
            "perf/tflops_per_sec_per_device": achieved / devices,
        }
        if self.peak_tflops:
            metrics["perf/mfu"] = achieved / devices / self.peak_tflops
        return metrics


def _exposed_comm_s(model: Any, blocked: list[float]) -> float:
    """This rank's exposed communication per step (`comm_clock`); -1 where not measured."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        exposed = ddp_exposed_s(model)
        return -1.0 if exposed is None else exposed
    if blocked and any(blocked):
        return float(np.median(blocked))
    return -1.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_rows(values: list[float], device: torch.device) -> list[list[float]]:
    """One row of values from every rank, on every rank (a sum of one-hot rows: a single
    all_reduce, available in every torch release and backend)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [values]
    rows = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    rows[dist.get_rank()] = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(rows)
    return rows.tolist()
