"""`strategy=fsdp`'s settings, before any worker starts: what FSDP cannot honour is
refused with the fix, instead of failing (or being ignored) in every worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_template.errors import ConfigError
from ddp_template.worker.sharding import FSDP_PRECISIONS, missing_classes

if TYPE_CHECKING:
    from omegaconf import DictConfig


def check_sharding(cfg: DictConfig) -> None:
    strategy = cfg.strategy
    if strategy.name != "fsdp":
        return
    if strategy.get("comm_hook", "none") != "none":
        raise ConfigError(
            "strategy.comm_hook",
            strategy.comm_hook,
            "none with strategy=fsdp: communication hooks are DDP's (they replace its "
            "all-reduce; FSDP reduce-scatters each unit's gradients instead)",
            f"drop strategy.comm_hook, or use strategy=ddp strategy.comm_hook={strategy.comm_hook}",
        )
    if cfg.precision not in FSDP_PRECISIONS:
        fix = (
            "precision=bf16-mixed (no loss scaling needed), or strategy=ddp for 16-mixed"
            if str(cfg.precision) in ("16-mixed", "16")
            else "precision=32-true"
        )
        raise ConfigError(
            "precision",
            cfg.precision,
            f"one of {', '.join(FSDP_PRECISIONS)} with strategy=fsdp (those of Lightning's "
            "ModelParallelStrategy; it has no loss scaler for 16-mixed)",
            fix,
        )
    if cfg.sync_batchnorm:
        raise ConfigError(
            "sync_batchnorm",
            True,
            "false with strategy=fsdp: SyncBatchNorm is DDP's conversion and is not applied "
            "to sharded modules here (and needs CUDA)",
            "drop sync_batchnorm=true, or use strategy=ddp sync_batchnorm=true on GPUs",
        )
    if strategy.cpu_offload and cfg.accelerator != "cuda":
        raise ConfigError(
            "strategy.cpu_offload",
            True,
            f"only on CUDA, and accelerator={cfg.accelerator}: on the CPU the parameters, "
            "gradients and optimizer state are in host memory already",
            "drop strategy.cpu_offload=true",
        )
    _check_wrap(cfg)


def _check_wrap(cfg: DictConfig) -> None:
    """Every class `strategy.wrap` names is a module of the task's network."""
    import torch
    from torch import nn

    wrap = cfg.strategy.wrap
    if wrap is None:
        return
    from ddp_template.build import build_task

    with torch.device("meta"):
        _, module = build_task(cfg)
    network = getattr(module, "model", None)
    if not isinstance(network, nn.Module):
        raise ConfigError(
            "strategy",
            "fsdp",
            f"a task whose module keeps its network as `self.model` ({type(module).__name__} "
            "has none): that is what strategy=fsdp shards",
            "build the network with `self.model = build_model(...)` in the task's module",
        )
    missing = missing_classes(network, tuple(wrap))
    if missing:
        present = sorted(
            {type(m).__name__ for m in network.modules() if any(True for _ in m.parameters())}
        )
        raise ConfigError(
            "strategy.wrap",
            list(wrap),
            f"class names of modules with parameters in the task's network; it has no "
            f"{', '.join(missing)} (it has {', '.join(present)})",
            f"e.g. strategy.wrap=[{present[-1]}], or strategy.wrap=null: every child of "
            "the network",
        )
