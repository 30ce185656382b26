"""Gradient-sync check: every rank must hold the same gradients and the same weights.

After DDP's all-reduce every rank holds bit-identical gradients (the collective returns the
same bytes everywhere), and identical gradients applied to identical weights keep the
weights identical. A rank that skipped an all-reduce, changed its weights on its own or
stepped its optimizer a different number of times breaks that, silently: the run goes on
with ranks training different models.

The check reads, it never writes: each rank sums every parameter's gradient and value in
float64, the sums of all ranks are gathered (one all_gather of 2 numbers per parameter),
and every rank compares them, so all ranks reach the same verdict and stop together.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist

from ddp_template.errors import TrainingStopped


class GradSyncCheck(L.Callback):
    """Compares gradients and weights across ranks every `every_n_steps` optimizer steps.

    Runs in `on_before_optimizer_step`: after the backward that all-reduced the gradients
    (with gradient accumulation, the last micro-batch's; the micro-batches before it skip
    the all-reduce, so their partial gradients differ by design) and before the optimizer
    uses and clears them. A mismatch stops the run, naming the first parameter that differs
    and the ranks that disagree.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = every_n_steps
        self.checks = 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if trainer.world_size < 2 or trainer.global_step % self.every_n_steps:
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        names, sums = parameter_checksums(pl_module)
        gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, sums)
        self.checks += 1
        message = describe_mismatch(names, [g.cpu() for g in gathered], trainer.global_step)
        if message:
            raise TrainingStopped(message)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.checks:
            print(
                f"sync check: gradients and weights identical on all {trainer.world_size} ranks "
                f"at the {self.checks} optimizer step(s) checked",
                flush=True,
            )


def parameter_checksums(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names, and a (parameters, 2) float64 tensor: the sum of each gradient (NaN when it
    has none) and the sum of each value. Fresh tensors: the parameters are not touched."""
    names, rows = [], []
    nan = None
    for name, param in module.named_parameters():
        if nan is None:
            nan = torch.tensor(float("nan"), dtype=torch.float64, device=param.device)
        grad = param.grad.detach().double().sum() if param.grad is not None else nan
        rows.append(torch.stack([grad, param.detach().double().sum()]))
        names.append(name)
    if not rows:
        return [], torch.zeros(0, 2, dtype=torch.float64)
    return names, torch.stack(rows)


def describe_mismatch(names: list[str], ranks: list[torch.Tensor], step: int) -> str | None:
    """None when every rank holds the same sums; otherwise what differs, and where."""
    reference = ranks[0]
    differs = torch.zeros(reference.shape, dtype=torch.bool)
    for other in ranks[1:]:
        differs |= ~_same(reference, other)
    if not differs.any():
        return None
    index, column = (int(i) for i in differs.nonzero()[0])
    what = ("gradient", "value")[column]
    values = [float(r[index, column]) for r in ranks]
    disagree = [rank for rank, v in enumerate(values) if not _same_number(v, values[0])]
    shown = ", ".join(f"rank {rank}: {v:.17g}" for rank, v in enumerate(values) if rank < 8)
    count = int(differs.any(dim=1).sum())
    return (
        f"Ranks out of sync at global step {step}: the first parameter that differs is "
        f"{names[index]} (its {what}; sums {shown}); rank(s) {_ranks(disagree)} disagree with "
        f"rank 0; {count} of {len(names)} parameters differ. Every rank must apply the same "
        "update: look for code that changes weights or gradients on some ranks only, skips "
        "a backward or an optimizer step on some ranks, or runs under no_sync() by mistake."
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def _same_number(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:16]) + (" ..." if len(ranks) > 16 else "")
