"""Config -> Lightning objects: task, strategy, callbacks, loggers, Trainer."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy
from omegaconf import DictConfig, OmegaConf

from ddp_template.callbacks.memory_report import ModelStateMemory
from ddp_template.callbacks.model_summary import TrainingFlopsSummary
from ddp_template.callbacks.progress import on_terminal
from ddp_template.callbacks.shared_disk import SharedDiskCheck
from ddp_template.errors import ConfigError
from ddp_template.launch.starters import cluster_environment
from ddp_template.resume.agreement import ResumeAgreement
from ddp_template.resume.attempts import AttemptLog
from ddp_template.resume.checkpoint_io import SafeCheckpointIO
from ddp_template.resume.loader_position import LoaderPosition
from ddp_template.worker.node_agreement import NodeCheckedDDPStrategy, flat_config
from ddp_template.worker.sharding import ShardedStrategy, ShardingOptions
from ddp_template.worker.trackers import log_config


def build_task(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule]:
    """The task's DataModule (no data read yet) and LightningModule, sized to the data by
    the DataModule's `sizes()` (input width, number of classes, ...)."""
    try:
        datamodule = instantiate(cfg.task.datamodule, **cfg.data, seed=cfg.seed)
        # Plain containers (not DictConfig) in hyper-parameters keep checkpoints loadable
        # with torch.load(weights_only=True). The network's node reaches the module as it
        # is (the module builds it with `module.build_model`): a built network in the
        # hyper-parameters would not load.
        options = cast(dict, OmegaConf.to_container(cfg.task.module, resolve=True))
        model = {"model": options.pop("model")} if "model" in options else {}
        module_factory = instantiate(options, **datamodule.sizes(), _partial_=True, _convert_="all")
        module = module_factory(**model)
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        raise
    if cfg.task.get("monitor"):
        module.monitor = (cfg.task.monitor, cfg.task.monitor_mode)
    return datamodule, module


# Keys of the strategy group that are ours, not DistributedDataParallel's.
_STRATEGY_KEYS = {
    "name",
    "process_group_backend",
    "timeout",
    "comm_hook",
    "powersgd_rank",
    "powersgd_start_iter",
}


def build_strategy(cfg: DictConfig) -> Strategy | str:
    """`strategy=auto` stays Lightning's "auto" for one process and becomes DDP for several;
    `strategy=fsdp` shards the model (worker/sharding.py)."""
    options = OmegaConf.to_container(cfg.strategy, resolve=True)
    name = options["name"]
    # Compared between nodes before the process group starts (node_agreement).
    node_config = flat_config(cfg)
    if name == "auto":
        return NodeCheckedDDPStrategy(node_config=node_config) if world_size(cfg) > 1 else "auto"
    if name == "fsdp":
        return _sharded_strategy(options, world_size(cfg), node_config)
    ddp_kwargs = ddp_arguments({str(k): v for k, v in options.items() if k not in _STRATEGY_KEYS})
    return NodeCheckedDDPStrategy(
        node_config=node_config,
        comm_hook=options["comm_hook"],
        powersgd_rank=options["powersgd_rank"],
        powersgd_start_iter=options["powersgd_start_iter"],
        start_method="spawn" if name == "ddp_spawn" else "popen",
        process_group_backend=options["process_group_backend"],
        timeout=timedelta(seconds=options["timeout"]),
        **ddp_kwargs,
    )


def ddp_arguments(options: dict[str, Any]) -> dict[str, Any]:
    """DistributedDataParallel's arguments; `forward_sync_buffers` was `broadcast_buffers`
    before torch 2.13 (the same switch of the per-forward broadcast)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    accepted = inspect.signature(DistributedDataParallel).parameters
    if "forward_sync_buffers" in options and "forward_sync_buffers" not in accepted:
        options["broadcast_buffers"] = options.pop("forward_sync_buffers")
    return options


def _sharded_strategy(
    options: dict[str, Any], ranks: int, node_config: dict[str, Any]
) -> ShardedStrategy:
    return ShardedStrategy(
        world_size=ranks,
        sharding=ShardingOptions.of(options),
        node_config=node_config,
        async_save=options["async_save"],
        process_group_backend=options["process_group_backend"],
        timeout=timedelta(seconds=options["timeout"]),
    )


def world_size(cfg: DictConfig) -> int:
    return int(cfg.devices) * int(cfg.num_nodes)


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """`logger=csv`, `logger=[csv,tensorboard]`: one tracker per option under `logger.<name>`.
    Each receives the resolved config as its hyper-parameters (written by rank 0 only)."""
    loggers = [instantiate(node) for node in (cfg.get("logger") or {}).values() if node]
    log_config(loggers, OmegaConf.to_container(cfg, resolve=True))
    return loggers


def build_callbacks(cfg: DictConfig) -> list[Callback]:
    callbacks = []
    for node in (cfg.get("callbacks") or {}).values():
        # The learning-rate monitor refuses to start without a tracker to write to.
        if node and not (node._target_ == _LR_MONITOR and not cfg.get("logger")):
            callbacks.append(instantiate(node))
    callbacks.append(SharedDiskCheck())
    # One checkpoint for all ranks, the training loader's position on resume at any world
    # size, and the attempts the run took (results.json): not optional.
    callbacks += [
        ResumeAgreement(),
        LoaderPosition(),
        AttemptLog(resume=bool(cfg.get("resume", False))),
        # Parameters, gradients and optimizer state per rank (results.json).
        ModelStateMemory(),
    ]
    return callbacks


_LR_MONITOR = "lightning.pytorch.callbacks.LearningRateMonitor"


def _with_safe_checkpoint_io(plugins: Any) -> list[Any]:
    """`trainer.plugins`, plus checkpoints written so that they cannot be torn, unless the
    config names a checkpoint IO of its own."""
    given = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
    if any(isinstance(plugin, CheckpointIO) for plugin in given):
        return given
    return [*given, SafeCheckpointIO()]


def build_trainer(cfg: DictConfig, loggers: list[Logger] | None = None) -> L.Trainer:
    """The Trainer of a worker; `loggers=[]` builds it without opening any tracker."""
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    callbacks = build_callbacks(cfg)
    # callbacks.progress draws a bar on a terminal and prints lines anywhere else; without
    # it, Lightning's own bar only on a terminal.
    has_progress = any(isinstance(c, ProgressBar) for c in callbacks)
    if trainer_args.get("enable_progress_bar") is None:
        trainer_args["enable_progress_bar"] = has_progress or on_terminal()
    if not trainer_args["enable_progress_bar"]:
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    trainer_args["plugins"] = _with_safe_checkpoint_io(trainer_args.get("plugins"))
    if trainer_args.get("enable_model_summary", True):
        # Lightning's own would print `Total FLOPs: 0` (callbacks/model_summary.py).
        callbacks.append(TrainingFlopsSummary())
    environment = cluster_environment()
    if environment is not None:
        trainer_args["plugins"] = [*trainer_args["plugins"], environment]
    return L.Trainer(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        precision=cfg.precision,
        strategy=build_strategy(cfg),
        sync_batchnorm=cfg.sync_batchnorm,
        callbacks=callbacks,
        logger=build_loggers(cfg) if loggers is None else loggers,
        default_root_dir=cfg.paths.output_dir,
        **trainer_args,
    )
