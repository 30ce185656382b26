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

from ddp_template.build import build_task, build_trainer
from ddp_template.errors import ConfigError, refusal_as_config_error
from ddp_template.metrics import check_monitor
from ddp_template.schema import as_override
from ddp_template.schema import parameter_default as _default

if TYPE_CHECKING:
    from ddp_template.module import TaskModule


def check_by_building(cfg: DictConfig) -> None:
    """Builds the DataModule, the LightningModule, the Trainer (strategy, callbacks) and the
    optimizer and scheduler of `configure_optimizers` once, and drops them. Reads no data,
    starts no process group, opens no tracker (their settings are checked by
    `check_trackers`), allocates no weights (meta device) and leaves the environment and
    torch's global flags as they were."""
    with _no_traces():
        with _refusals(cfg, "data", "task.module"), torch.device("meta"):
            _, module = build_task(cfg)
        # Every task's module is a TaskModule, which declares the metrics it logs.
        metrics = cast("TaskModule", module).metrics
        check_monitor(cfg.task.get("monitor"), cfg.task.get("monitor_mode"), metrics)
        with _refusals(cfg, "trainer", "strategy", "callbacks", *_TOP_LEVEL):
            trainer = build_trainer(cfg, loggers=[])
        with _refusals(cfg, "task.module.optimizer", "task.module.scheduler"):
            # Counting the optimizer steps of an epoch needs the data. The run's max_steps
            # when set, else any count, builds the same optimizer and scheduler.
            max_steps = int(cfg.trainer.max_steps)
            trainer.fit_loop.max_epochs = -1
            trainer.fit_loop.epoch_loop.max_steps = max_steps if max_steps > 0 else 1000
            module.trainer = trainer
            module.configure_optimizers()


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
    """Every value under `nodes` by full key, and the default of each instantiated one."""
    values: dict[str, Any] = {}
    fixes: dict[str, str] = {}

    def walk(node: Any, path: str, target: str | None) -> None:
        if not isinstance(node, dict):
            values[path] = node
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
    logging_disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging_disabled)
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        os.environ.clear()
        os.environ.update(environment)
