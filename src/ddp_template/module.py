"""The LightningModule base every task builds on: it declares what the task logs, owns
the optimizer and scheduler (built by `optim.py`), and builds the network the task config
names (`build_model`)."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from ddp_template import optim
from ddp_template.errors import ConfigError


def build_model(model: dict[str, Any], **sizes: Any) -> nn.Module:
    """The network of `task.module.model`: its `_target_` (a class or function, e.g. of the
    task's model.py) called with the node's other keys and the data's `sizes` (what the
    DataModule's `sizes()` says: num_classes, in_channels, ...). Replacing the network is
    then a new class in model.py and its name in the task config; the module is unchanged."""
    if "_target_" not in model:
        raise ConfigError(
            "task.module.model._target_",
            None,
            "the class or function that builds the network (this model node names none)",
            "add it to the task config, e.g. "
            "_target_: ddp_template.tasks.image_classification.model.build_resnet",
        )
    try:
        return instantiate(model, **sizes, _convert_="all")
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        raise


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

    def configure_model(self) -> None:
        """`strategy=fsdp` shards the network here (Lightning calls this on every rank
        before the optimizer is built); other strategies have no `shard` and leave it."""
        shard = getattr(self.trainer.strategy, "shard", None) if self._trainer else None
        if shard is not None:
            shard(self.model)

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
