"""Peak memory over the ranks, printed by rank 0 at the end of each training epoch.

The numbers are those SpeedMonitor gathers over ranks (`perf/peak_mem_mb/...`, and
`perf/peak_reserved_mb/...` on CUDA: min, median, max and the ranks holding the min and the
max), which results.json keeps; list this callback after `speed_monitor`. One rank far
above the others points at what only it does (rank 0's logging or evaluation, an uneven
batch); all ranks growing epoch after epoch, at a leak.
"""

from __future__ import annotations

import lightning as L

from ddp_template.worker.over_ranks import over_ranks, spread


class MemoryReport(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        allocated = over_ranks(metrics, "perf/peak_mem_mb")
        if allocated is None:
            return
        reserved = over_ranks(metrics, "perf/peak_reserved_mb")
        line = f"peak memory, epoch {trainer.current_epoch + 1}"
        if reserved:
            line += (
                f" (CUDA allocated/reserved, MiB): {_shown(allocated)}; reserved {_shown(reserved)}"
            )
        else:
            line += f" (host RSS, MiB): {_shown(allocated)}"
        _print(trainer, line)


def _shown(figure: dict) -> str:
    if figure["min_rank"] == figure["max_rank"]:
        return f"{figure['max']:,.0f} (rank {figure['max_rank']})"
    return (
        f"min {figure['min']:,.0f} (rank {figure['min_rank']})  median {figure['median']:,.0f}"
        f"  max {figure['max']:,.0f} (rank {figure['max_rank']})"
    )


def _print(trainer: L.Trainer, line: str) -> None:
    """Above a live progress bar when there is one, else a plain line."""
    bar = trainer.progress_bar_callback
    if bar is not None and hasattr(bar, "print"):
        bar.print(line)
    else:
        print(line, flush=True)


MODEL_STATE_PARTS = ("parameters", "gradients", "optimizer_state")


class ModelStateMemory(L.Callback):
    """What every rank holds of the model's state, measured after the first optimizer step
    (when the gradients and the optimizer's state exist): parameters, gradients and
    optimizer state in MiB, each as its spread over the ranks and its sum (results.json:
    `model_state_mb_over_ranks`; a fixed number of keys at any world size). Under ddp each
    rank holds all of it; under fsdp about 1/W. Not optional (build.build_callbacks): every
    rank takes part in one all-gather of three numbers, once."""

    def __init__(self) -> None:
        # Read by results.collect_results by this name.
        self.model_state_mb_over_ranks: dict[str, dict[str, float]] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        from ddp_template.worker.memory import model_state_bytes

        if self.model_state_mb_over_ranks is not None:
            return
        mine = model_state_bytes(pl_module, trainer.optimizers)
        local = torch.tensor([mine[p] / 2**20 for p in MODEL_STATE_PARTS], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device))
        rows = gathered.reshape(-1, len(MODEL_STATE_PARTS)).cpu().tolist()
        self.model_state_mb_over_ranks = {
            part: model_state_spread([row[i] for row in rows])
            for i, part in enumerate(MODEL_STATE_PARTS)
        }
        if trainer.is_global_zero:
            _print(trainer, model_state_line(self.model_state_mb_over_ranks, len(rows)))


def model_state_spread(per_rank: list[float]) -> dict[str, float]:
    """One part's MiB over the ranks: min, median, max (and the ranks holding them), sum."""
    figures = {key.split("/", 1)[1]: value for key, value in spread("x", per_rank).items()}
    figures = {
        key: int(value) if key.endswith("_rank") else round(value, 6)
        for key, value in figures.items()
    }
    figures["sum"] = round(sum(per_rank), 6)
    return figures


def model_state_line(over_ranks: dict[str, dict[str, float]], ranks: int) -> str:
    """One line: each part's MiB on the rank holding most, and the total over ranks."""
    parts = [
        f"{part.replace('_', ' ')} {figures['max']:,.2f} (all ranks {figures['sum']:,.2f})"
        for part, figures in over_ranks.items()
    ]
    return f"model state per rank, largest of {ranks} (MiB): " + ", ".join(parts)
