"""Training throughput and peak memory, measured the same way for every run."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import extract_batch_size

from ddp_template.memory import peak_memory_mb


class SpeedMonitor(L.Callback):
    """Logs, at the end of each training epoch:

    - `perf/samples_per_sec`: samples processed by all ranks per second of training wall time
      (data loading included, the first `warmup_batches` of each epoch left out);
    - `perf/samples_per_sec_per_device`;
    - `perf/peak_mem_mb/rank_<N>`: peak memory of every rank (gathered, so rank 0 has all).

    Values are logged as metrics, so they also reach the main process under ddp_spawn.
    """

    def __init__(self, warmup_batches: int = 2) -> None:
        self.warmup_batches = warmup_batches
        self._start: float | None = None
        self._samples = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._samples = None, 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.warmup_batches:
            self._synchronize(pl_module.device)
            self._start = time.perf_counter()
        if self._start is not None:
            self._samples += extract_batch_size(batch)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        elapsed = 0.0
        if self._start is not None:
            self._synchronize(device)
            elapsed = time.perf_counter() - self._start
        # Every rank takes part in these collectives, whether it measured a window or not.
        samples = trainer.strategy.reduce(
            torch.tensor(float(self._samples), device=device), reduce_op="sum"
        )
        slowest = trainer.strategy.reduce(torch.tensor(elapsed, device=device), reduce_op="max")
        peaks = _gather_floats(peak_memory_mb(device), device)
        metrics = {f"perf/peak_mem_mb/rank_{rank}": peak for rank, peak in enumerate(peaks)}
        if float(slowest) > 0:
            rate = float(samples) / float(slowest)
            metrics["perf/samples_per_sec"] = rate
            metrics["perf/samples_per_sec_per_device"] = rate / trainer.world_size
        # Already reduced over ranks: every rank logs the same value.
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False)

    @staticmethod
    def _synchronize(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _gather_floats(value: float, device: torch.device) -> list[float]:
    """One value from every rank, on every rank (a sum of one-hot slots: one all_reduce,
    available in every torch release)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    slots = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    slots[dist.get_rank()] = value
    dist.all_reduce(slots)
    return slots.tolist()
