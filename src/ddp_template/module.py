"""The LightningModule base every task builds on: it declares what the task logs and owns
the optimizer and scheduler (built by `optim.py`)."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L

from ddp_template import optim


class TaskModule(L.LightningModule):
    """Subclasses set `metrics`, the names they log under every stage (`train/<name>`,
    `val/<name>`, `test/<name>`): the config check refuses a `task.monitor` that is not one
    of them before any worker starts.

    Subclasses call `self.save_hyperparameters(ignore=["optimizer", "scheduler"])`: the
    factories are code, not hyper-parameters, and keeping them out lets checkpoints load
    with torch.load(weights_only=True)."""

    metrics: ClassVar[tuple[str, ...]] = ()
    # The task's monitored metric and its mode (task.monitor, task.monitor_mode), set by
    # `build.build_task`: a ReduceLROnPlateau scheduler steps on it.
    monitor: tuple[str, str] | None = None

    def __init__(
        self,
        optimizer: optim.OptimizerFactory | None = None,
        scheduler: optim.SchedulerFactory | None = None,
        scheduler_interval: str = "step",
    ) -> None:
        super().__init__()
        optim.check_interval(scheduler_interval)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval

    def configure_optimizers(self) -> Any:
        return optim.configure(
            self.parameters(),
            self.optimizer_factory,
            self.scheduler_factory,
            self.scheduler_interval,
            self.trainer,
            self.monitor,
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        optim.drop_run_length_state(checkpoint)
