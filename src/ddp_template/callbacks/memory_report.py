"""Peak memory of every rank, printed by rank 0 at the end of each training epoch.

The numbers are those SpeedMonitor gathers over ranks (`perf/peak_mem_mb/rank_<N>`, and
`perf/peak_reserved_mb/rank_<N>` on CUDA), which results.json keeps; list this callback
after `speed_monitor`. One rank far above the others points at what only it does (rank 0's
logging or evaluation, an uneven batch); all ranks growing epoch after epoch, at a leak.
"""

from __future__ import annotations

import lightning as L

_ALLOCATED = "perf/peak_mem_mb/rank_"
_RESERVED = "perf/peak_reserved_mb/rank_"
# More ranks than this: only the lowest and the highest are printed.
_LISTED_RANKS = 16


class MemoryReport(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        allocated = _per_rank(metrics, _ALLOCATED)
        if not allocated:
            return
        reserved = _per_rank(metrics, _RESERVED)
        if reserved:
            kind = "CUDA allocated/reserved"
            values = {r: f"{allocated[r]:,.0f}/{reserved.get(r, 0):,.0f}" for r in allocated}
        else:
            kind = "host RSS"
            values = {r: f"{allocated[r]:,.0f}" for r in allocated}
        top = max(allocated, key=allocated.get)
        low = min(allocated, key=allocated.get)
        if len(values) > _LISTED_RANKS:
            # results.json keeps every rank; the console shows the spread.
            values = {low: values[low], top: values[top]}
        listed = "  ".join(f"rank {r} {v}" for r, v in sorted(values.items()))
        line = (
            f"peak memory, epoch {trainer.current_epoch + 1} ({kind}, MiB): {listed}"
            f"  (max: rank {top})"
        )
        _print(trainer, line)


def _per_rank(metrics, prefix: str) -> dict[int, float]:
    return {int(k[len(prefix) :]): float(v) for k, v in metrics.items() if k.startswith(prefix)}


def _print(trainer: L.Trainer, line: str) -> None:
    """Above a live progress bar when there is one, else a plain line."""
    bar = trainer.progress_bar_callback
    if bar is not None and hasattr(bar, "print"):
        bar.print(line)
    else:
        print(line, flush=True)
