"""The real objects of a run, built once in the launching process and dropped, so that
whatever a library refuses is refused before any worker starts, as a `ConfigError` that
names the key."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddp_template.build import build_task, build_trainer, world_size
from ddp_template.config.schema import as_override
from ddp_template.config.schema import parameter_default as _default
from ddp_template.data import drops_lone_sample, require_one_sample_per_rank, training_batches
from ddp_template.errors import ConfigError, refusal_as_config_error
from ddp_template.metrics import check_monitor

if TYPE_CHECKING:
    from ddp_template.data import ShardedDataModule
    from ddp_template.module import TaskModule


def check_by_building(cfg: DictConfig) -> None:
    """Builds the DataModule, the LightningModule, the Trainer (strategy, callbacks) and the
    optimizer and scheduler of `configure_optimizers` once, and drops them. Reads no data,
    starts no process group, opens no tracker (their settings are checked by
    `check_trackers`), allocates no weights (meta device) and leaves the environment and
    torch's global flags as they were."""
    with _no_traces():
        with _refusals(cfg, "data", "task.module"), torch.device("meta"):
            datamodule, module = build_task(cfg)
        # Every task's module is a TaskModule, which declares the metrics it logs.
        metrics = cast("TaskModule", module).metrics
        check_monitor(cfg.task.get("monitor"), cfg.task.get("monitor_mode"), metrics)
        with _refusals(cfg, "trainer", "strategy", "callbacks", *_TOP_LEVEL):
            trainer = build_trainer(_buildable_here(cfg), loggers=[])
        with _refusals(cfg, "task.module.optimizer", "task.module.scheduler"):
            if cast("TaskModule", module).scheduler_interval == "step":
                # Counting the optimizer steps of an epoch needs the data. The run's
                # max_steps when set (or none: an endless run), else any count, builds the
                # same optimizer and scheduler.
                max_steps = int(cfg.trainer.max_steps)
                endless = cfg.trainer.get("max_epochs") == -1 and max_steps < 0
                trainer.fit_loop.max_epochs = -1
                trainer.fit_loop.epoch_loop.max_steps = (
                    max_steps if max_steps > 0 or endless else 1000
                )
            module.trainer = trainer
            module.configure_optimizers()
    # A source's own check of its files (an image folder's), once, here.
    check_files = getattr(cast("ShardedDataModule", datamodule).source, "check_files", None)
    if check_files is not None:
        check_files()
    sizes = cast("ShardedDataModule", datamodule).split_sizes()
    if sizes is not None:
        check_split_sizes(cfg, sizes, module)


def _buildable_here(cfg: DictConfig) -> DictConfig:
    """A dry run plans GPUs this machine may not have: its Trainer is built for one CPU
    process (the world's size is checked from the config, below)."""
    if not (cfg.get("dry_run") and cfg.accelerator == "cuda"):
        return cfg
    here = cfg.copy()
    here.accelerator, here.devices, here.num_nodes = "cpu", 1, 1
    here.sync_batchnorm = False
    return here


def check_split_sizes(cfg: DictConfig, sizes: tuple[int, int, int], model: torch.nn.Module) -> None:
    """What follows from the number of samples: the batches of an epoch on each rank (at
    least one, and as many as the validation interval counts), and a sample of each
    evaluation split for every rank."""
    world = world_size(cfg)
    train, val, test = sizes
    data, trainer = cfg.data, cfg.trainer
    # Each rank's shard: padded to the same length, or cut to it with drop_last.
    shard = train // world if data.drop_last else -(-train // world)
    if data.batch_size > shard:
        fits = 2 ** (max(shard, 1).bit_length() - 1)
        raise ConfigError(
            "data.batch_size",
            data.batch_size,
            f"at most the {shard} training samples a rank holds (data={data.name}: {train} "
            f"training samples over {world} rank(s)): a larger batch would make "
            + (
                "no step at all (data.drop_last=true)"
                if data.drop_last
                else "one short step an epoch"
            ),
            f"e.g. data.batch_size={fits}" + (", or fewer devices" if world > 1 else ""),
        )
    drop = data.drop_last or drops_lone_sample(shard, data.batch_size, model)
    batches = training_batches(shard, data.batch_size, drop)
    if not (trainer.get("fast_dev_run") or trainer.get("overfit_batches")):
        _check_epoch_batches(trainer, batches)
    if trainer.get("limit_val_batches") != 0:
        require_one_sample_per_rank(val, world, "the validation")
    if cfg.get("test", True):
        require_one_sample_per_rank(test, world, "the test")


def _check_epoch_batches(trainer: DictConfig, batches: int) -> None:
    limit = trainer.get("limit_train_batches")
    if isinstance(limit, float):
        if int(batches * limit) < 1:
            raise ConfigError(
                "trainer.limit_train_batches",
                limit,
                f"a fraction that leaves at least one of the {batches} training batches of an "
                "epoch on each rank",
                f"e.g. trainer.limit_train_batches={1 / batches:.3g} or a number of batches",
            )
        batches = int(batches * limit)
    elif isinstance(limit, int):
        batches = min(batches, limit)
    interval = trainer.get("val_check_interval")
    counted_per_epoch = trainer.get("check_val_every_n_epoch") is not None
    if isinstance(interval, int) and counted_per_epoch and interval > batches:
        raise ConfigError(
            "trainer.val_check_interval",
            interval,
            f"a number of training batches up to the {batches} of an epoch on each rank (or a "
            "fraction of an epoch)",
            f"e.g. trainer.val_check_interval={batches}, or 0.5; or add "
            "trainer.check_val_every_n_epoch=null to count batches across epochs",
        )


_TOP_LEVEL = ("accelerator", "devices", "num_nodes", "precision", "sync_batchnorm")


# How the libraries say no (Hydra wraps the others in InstantiationException).
_REFUSALS = (
    ValueError,
    TypeError,
    LookupError,
    ImportError,
    MisconfigurationException,
    InstantiationException,
    OmegaConfBaseException,
)


@contextlib.contextmanager
def _refusals(cfg: DictConfig, *nodes: str) -> Iterator[None]:
    try:
        yield
    except ConfigError:
        raise
    except _REFUSALS as err:
        values, fixes = _leaves(cfg, nodes)
        raise refusal_as_config_error(err, values, nodes[0], fixes) from None


def _leaves(cfg: DictConfig, nodes: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every value under `nodes` by full key, and the default of each: the config's own
    (what conf/ gives without the command line's values), else the instantiated class's."""
    values: dict[str, Any] = {}
    fixes: dict[str, str] = {}
    pristine = _config_without_values()

    def walk(node: Any, path: str, target: str | None) -> None:
        if not isinstance(node, dict):
            values[path] = node
            ours = _select(pristine, path)
            if ours is not MISSING and ours != node:
                fixes[path] = f"e.g. {path}={as_override(ours)} (the config's default)"
                return
            default = _default(target, path.rsplit(".", 1)[-1]) if target else MISSING
            if default is not MISSING:
                fixes[path] = f"e.g. {path}={as_override(default)} (the default)"
            return
        target = node.get("_target_", target)
        for key, child in node.items():
            if not key.startswith("_"):
                walk(child, f"{path}.{key}", target)

    for name in nodes:
        node = OmegaConf.select(cfg, name)
        node = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        walk(node, name, "lightning.Trainer" if name in ("trainer", *_TOP_LEVEL) else None)
    return values, fixes


def _config_without_values() -> DictConfig | None:
    """The run's config as conf/ gives it for the command line's choices of config groups
    (`task=regression`), without its values (`task.module.optimizer.lr=-1`); None outside
    a Hydra run. Composed only when a value was refused."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from ddp_template.project import CONFIG_DIR

    if not HydraConfig.initialized():
        return None
    choices = [o for o in HydraConfig.get().overrides.task if "." not in o.split("=", 1)[0]]
    hydra = GlobalHydra.instance()
    # compose() needs a GlobalHydra of its own; the run's one is put back after.
    state = hydra.hydra
    hydra.clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return compose("train", overrides=choices)
    except Exception:  # noqa: BLE001 - without it the class's default is named instead
        return None
    finally:
        hydra.clear()
        if state is not None:
            hydra.initialize(state)


def _select(cfg: DictConfig | None, path: str) -> Any:
    if cfg is None:
        return MISSING
    try:
        value = OmegaConf.select(cfg, path, default=MISSING, throw_on_resolution_failure=False)
    except OmegaConfBaseException:
        return MISSING
    return MISSING if isinstance(value, DictConfig) else value


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No log record below an error and no warning while objects are built for a check:
    what they report is the workers' to print (or, without a Trainer, not true)."""
    logging_disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging_disabled)


@contextlib.contextmanager
def _no_traces() -> Iterator[None]:
    """Lightning sets environment variables and torch's global flags while it builds, and
    logs what it found (the workers print that)."""
    environment = dict(os.environ)
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        with quiet():
            yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        os.environ.clear()
        os.environ.update(environment)
