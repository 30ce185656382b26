"""What the run really does, read from the live trainer: one table on rank 0 when training
starts (after the loaders and the DDP wrapper exist)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, DistributedSampler

from ddp_template.callbacks.ddp_settings import read_ddp_settings
from ddp_template.launch.topology import available_cores, global_batch_text, workers_per_rank
from ddp_template.worker.node_agreement import describe_nodes


class StartupReport(L.Callback):
    """Prints the DDP set-up once, on rank 0, and warns when the loader workers of the
    ranks on a node need more cores than the node has."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        rows, warnings = startup_rows(trainer)
        table = Table(title="DDP set-up", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for name, value in rows:
            table.add_row(name, value)
        console = Console()
        console.print(table)
        for warning in warnings:
            console.print(f"warning: {warning}", style="yellow", highlight=False, soft_wrap=True)


def startup_rows(trainer: L.Trainer) -> tuple[list[tuple[str, str]], list[str]]:
    """(name, value) rows of the report, and the warnings that go below it."""
    loader = trainer.train_dataloader
    batch = getattr(loader, "batch_size", None)
    accumulation = trainer.accumulate_grad_batches
    world = trainer.world_size
    workers = getattr(loader, "num_workers", 0)
    local_ranks = trainer.num_devices
    cores = available_cores()
    rows = [
        ("world size", f"{world} = {trainer.num_nodes} node(s) x {local_ranks} device(s)"),
        ("device", str(trainer.strategy.root_device)),
        ("batch per device", str(batch)),
        (
            "global batch",
            global_batch_text(batch, world, accumulation) if batch else "n/a",
        ),
        ("precision used", str(trainer.precision)),
        ("backend", _backend(trainer)),
        ("network", describe_nodes()),
        ("DDP", _ddp_text(trainer)),
        ("model state", _model_state_text(trainer)),
        ("sampler", _sampler_text(loader)),
        *_task_rows(trainer),
        (
            "loader workers",
            f"{workers} per rank ({_workers_reason(trainer, workers, local_ranks, cores)}): "
            f"{local_ranks} x (1 + {workers}) processes on {cores} cores, "
            f"{torch.get_num_threads()} torch threads per rank",
        ),
        ("compile", _compile_text(trainer.lightning_module)),
        ("debug", _debug_text(trainer)),
        ("job folder", str(trainer.default_root_dir)),
        ("checkpoints", _checkpoint_dir(trainer)),
        ("logs", _log_dirs(trainer)),
    ]
    warning = oversubscription_warning(local_ranks, workers, cores)
    return rows, [warning] if warning else []


def _task_rows(trainer: L.Trainer) -> list[tuple[str, str]]:
    """The input size and the model, as the data source and the network describe themselves
    (a `describe_input()` of the DataModule, a `description` of the module's `model`)."""
    rows = []
    describe_input = getattr(trainer.datamodule, "describe_input", None)
    if describe_input is not None:
        rows.append(("input", describe_input()))
    model = getattr(getattr(trainer.lightning_module, "model", None), "description", None)
    if model:
        rows.append(("model", model))
    return rows


def _workers_reason(trainer: L.Trainer, workers: int, local_ranks: int, cores: int) -> str:
    """Why this many: the data set's default (conf/data/), or a value set by hand."""
    decoded = getattr(trainer.datamodule, "decoded_per_sample", None)
    if decoded is None:
        return "data.num_workers"
    default = workers_per_rank(local_ranks, minimum=0) if decoded else 0
    why = (
        f"samples decoded one by one: {cores} cores / {local_ranks} rank(s) - 1"
        if decoded
        else "tensors in memory load fastest in the training process"
    )
    if workers == default:
        return f"default, {why}"
    return f"data.num_workers; the default here would be {default}, {why}"


def _compile_text(module: L.LightningModule) -> str:
    if getattr(module, "_compiled_call_impl", None) is None:
        return "off (compile=true compiles the model's forward with torch.compile)"
    return "on: torch.compile on the LightningModule's forward; the first steps compile"


def oversubscription_warning(local_ranks: int, workers: int, cores: int) -> str | None:
    """Each rank is one process and each of its loader workers another: more of them than
    cores, and they take turns on the cores the training steps need."""
    processes = local_ranks * (1 + workers)
    if processes <= cores:
        return None
    if local_ranks > cores:
        # Fewer workers cannot help: the ranks themselves take turns on the cores.
        return (
            f"{local_ranks} ranks share {cores} core(s): each trains on a part of a core and "
            "waits for the slowest at every gradient all-reduce. That checks a DDP setup; to "
            f"train fast here use devices={cores} (or fewer)."
        )
    fair = max(0, cores // local_ranks - 1)
    return (
        f"{local_ranks} rank(s) x (1 + {workers} loader workers) = {processes} processes share "
        f"{cores} core(s): they compete with training. Try data.num_workers={fair}."
    )


def _backend(trainer: L.Trainer) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return "none (one process)"
    timeout = getattr(trainer.strategy, "_timeout", None)
    waits = f", timeout {timeout.total_seconds():.0f} s" if timeout else ""
    return f"{dist.get_backend()}{waits}"


def _ddp_text(trainer: L.Trainer) -> str:
    settings = read_ddp_settings(trainer.strategy.model)
    if settings is None:
        return "not wrapped (one process)"
    flags = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")
    flag_text = ", ".join(f"{flag}={bool(settings[flag])}" for flag in flags)
    return f"bucket_cap_mb={settings['bucket_cap_mb']:g}, {flag_text}"


def _model_state_text(trainer: L.Trainer) -> str:
    """Rank 0's share of the parameters (sharded by fsdp, whole under ddp); the gradients
    and the optimizer's state follow after the first step (results.json)."""
    from ddp_template.worker.memory import local_bytes

    parameters = list(trainer.lightning_module.parameters())
    mine = local_bytes(parameters) / 2**20
    whole = sum(p.numel() * p.element_size() for p in parameters) / 2**20
    share = f"{mine / whole:.0%} of {whole:,.2f} MiB" if whole else "no parameters"
    return (
        f"parameters {mine:,.2f} MiB on rank 0 ({share}); gradients, optimizer state: "
        "per rank after the first step (results.json model_state_mb_over_ranks)"
    )


def _sampler_text(loader: Any) -> str:
    if not isinstance(loader, DataLoader):
        return type(loader).__name__
    sampler = loader.sampler
    name = type(sampler).__name__
    if isinstance(sampler, DistributedSampler):
        # The resumable subclass is torch's sampler that can start mid-epoch: named as torch's.
        name = f"DistributedSampler(shuffle={sampler.shuffle}, drop_last={sampler.drop_last})"
    return f"{name}, loader drop_last={loader.drop_last}"


# The callbacks of conf/debug/, named in the report when they run.
_DEBUG_CALLBACKS = ("GradSyncCheck", "HangWatchdog", "TraceProfiler", "HostSyncFinder")


def _debug_text(trainer: L.Trainer) -> str:
    level = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
    recorder = os.environ.get("TORCH_FR_BUFFER_SIZE", "0")
    active = [type(c).__name__ for c in trainer.callbacks if type(c).__name__ in _DEBUG_CALLBACKS]
    return (
        f"TORCH_DISTRIBUTED_DEBUG={level}, flight recorder {recorder}, "
        f"detect_anomaly={torch.is_anomaly_enabled()}, " + (", ".join(active) or "no checks")
    )


def _checkpoint_dir(trainer: L.Trainer) -> str:
    callback = trainer.checkpoint_callback
    if callback is None or not callback.dirpath:
        return "none"
    return _in_job(trainer, callback.dirpath)


def _log_dirs(trainer: L.Trainer) -> str:
    parts = []
    if (Path(trainer.default_root_dir) / "logs").is_dir():
        parts.append("logs/attempt_<N>/<rank>/ (every rank)")
    if trainer.logger is not None and trainer.logger.log_dir:
        parts.append(f"{_in_job(trainer, trainer.logger.log_dir)} (metrics)")
    return ", ".join(parts) or "console only"


def _in_job(trainer: L.Trainer, path: str) -> str:
    """A path relative to the job folder when it is inside it (the row above names it)."""
    job = Path(trainer.default_root_dir).resolve()
    resolved = Path(path).resolve()
    return f"{resolved.relative_to(job)}/" if resolved.is_relative_to(job) else str(path)
