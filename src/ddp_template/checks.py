"""Every value a run depends on, checked before any worker process starts.

`check_config` resolves the values that depend on the machine (accelerator, devices) in
place, so that every worker reads the same concrete config, and raises `ConfigError` with
the key, the bad value, what is allowed and how to fix it.
"""

from __future__ import annotations

import inspect
import numbers
import zipfile
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, open_dict

from ddp_template.build import build_task
from ddp_template.callbacks.watchdog import ON_HANG
from ddp_template.comm_hooks import COMM_HOOKS
from ddp_template.debug import DISTRIBUTED_DEBUG_LEVELS
from ddp_template.errors import ConfigError
from ddp_template.launch import processes_started_externally
from ddp_template.metrics import check_monitor

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "64-true", "64", "16-true", "bf16-true")
STRATEGIES = ("auto", "ddp", "ddp_spawn")
# Trainer arguments that are top-level switches or built from their own config groups.
TRAINER_ARGS_ELSEWHERE = {
    "accelerator",
    "strategy",
    "devices",
    "num_nodes",
    "precision",
    "logger",
    "callbacks",
    "sync_batchnorm",
    "default_root_dir",
}


def check_config(cfg: DictConfig) -> None:
    with open_dict(cfg):
        cfg.accelerator = _resolve_accelerator(cfg.accelerator)
        cfg.devices = _resolve_devices(cfg.devices, cfg.accelerator)
    _check_whole_number("num_nodes", cfg.num_nodes, minimum=1)
    _check_whole_number("max_restarts", cfg.max_restarts, minimum=0)
    _check_precision(cfg.precision)
    _check_benchmark(cfg)
    _check_strategy(cfg)
    _check_trainer_args(cfg)
    _check_loader(cfg.data)
    _check_task_data(cfg)
    _check_sync_batchnorm(cfg)
    _check_debug(cfg)
    if cfg.ckpt_path is not None:
        check_checkpoint_file(cfg.ckpt_path)


def _resolve_accelerator(value: object) -> str:
    if value not in ACCELERATORS:
        raise ConfigError(
            "accelerator", value, f"one of {', '.join(ACCELERATORS)}", "e.g. accelerator=cpu"
        )
    if value == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if value in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            "accelerator",
            value,
            "a GPU, and torch sees none on this machine",
            "use accelerator=cpu",
        )
    return "cuda" if value == "gpu" else str(value)


def _resolve_devices(value: object, accelerator: str) -> int:
    if value == "auto":
        return torch.cuda.device_count() if accelerator == "cuda" else 1
    _check_whole_number("devices", value, minimum=1, allowed="a whole number >= 1 or 'auto'")
    if accelerator == "cuda" and value > torch.cuda.device_count():
        raise ConfigError(
            "devices",
            value,
            f"at most the {torch.cuda.device_count()} GPUs visible here",
            "lower devices or use more nodes",
        )
    return int(value)


def _check_whole_number(key: str, value: object, minimum: int, allowed: str | None = None) -> None:
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not is_int or value < minimum:
        raise ConfigError(
            key, value, allowed or f"a whole number >= {minimum}", f"e.g. {key}={max(minimum, 1)}"
        )


def _check_precision(value: object) -> None:
    if str(value) not in PRECISIONS:
        raise ConfigError(
            "precision",
            value,
            "one of Lightning's names: 32-true, 16-mixed, bf16-mixed, 64-true, 16-true, bf16-true",
            "e.g. precision=bf16-mixed",
        )


def _check_strategy(cfg: DictConfig) -> None:
    strategy = cfg.strategy
    if strategy.name not in STRATEGIES:
        raise ConfigError(
            "strategy", strategy.name, f"one of {', '.join(STRATEGIES)}", "e.g. strategy=ddp"
        )
    if cfg.num_nodes > 1 and not processes_started_externally():
        raise ConfigError(
            "num_nodes",
            cfg.num_nodes,
            "1 for the plain command: several nodes need a launcher that starts the processes",
            "start every node with torchrun (or srun), as shown in the README",
        )
    if strategy.name == "auto":
        return
    bucket = strategy.bucket_cap_mb
    if bucket is not None and (not isinstance(bucket, numbers.Real) or bucket <= 0):
        raise ConfigError(
            "strategy.bucket_cap_mb",
            bucket,
            "a size in MiB > 0, or null for PyTorch's default",
            "e.g. 25",
        )
    timeout = strategy.timeout
    if not isinstance(timeout, numbers.Real) or timeout <= 0:
        raise ConfigError("strategy.timeout", timeout, "seconds > 0", "e.g. strategy.timeout=1800")
    backend = strategy.process_group_backend
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ConfigError(
            "strategy.process_group_backend", backend, "null, gloo, nccl or mpi", "leave it null"
        )
    if backend == "nccl" and cfg.accelerator != "cuda":
        raise ConfigError(
            "strategy.process_group_backend", backend, "nccl needs CUDA devices", "use gloo on CPUs"
        )
    for key in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
        if not isinstance(strategy[key], bool):
            raise ConfigError(
                f"strategy.{key}", strategy[key], "true or false", f"strategy.{key}=false"
            )
    _check_comm_hook(strategy, cfg.accelerator)


def _check_comm_hook(strategy: DictConfig, accelerator: str) -> None:
    hook = strategy.comm_hook
    if hook not in COMM_HOOKS:
        raise ConfigError(
            "strategy.comm_hook",
            hook,
            f"one of {', '.join(COMM_HOOKS)} (PyTorch's DDP communication hooks)",
            "e.g. strategy.comm_hook=fp16",
        )
    if hook == "powersgd":
        _check_whole_number("strategy.powersgd_rank", strategy.powersgd_rank, minimum=1)
        # PyTorch requires >= 2 with error feedback (on by default).
        _check_whole_number("strategy.powersgd_start_iter", strategy.powersgd_start_iter, minimum=2)
    if hook == "bf16" and accelerator == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "strategy.comm_hook",
            hook,
            "bf16 compression needs a GPU with bfloat16 support (Ampere or newer)",
            "use strategy.comm_hook=fp16",
        )


def _check_benchmark(cfg: DictConfig) -> None:
    """`experiment=benchmark`: checked before trainer.max_steps (their sum) is resolved."""
    benchmark = cfg.get("benchmark")
    if benchmark is None:
        return
    _check_whole_number("benchmark.warmup_steps", benchmark.warmup_steps, minimum=0)
    _check_whole_number("benchmark.steps", benchmark.steps, minimum=1)


def _check_trainer_args(cfg: DictConfig) -> None:
    known = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    for key in cfg.trainer:
        if key in TRAINER_ARGS_ELSEWHERE:
            raise ConfigError(
                f"trainer.{key}", cfg.trainer[key], "set as a top-level switch", f"use `{key}=...`"
            )
        if key not in known:
            raise ConfigError(
                f"trainer.{key}",
                cfg.trainer[key],
                "a lightning.Trainer argument",
                "check the spelling",
            )


def _check_loader(data: DictConfig) -> None:
    _check_whole_number("data.batch_size", data.batch_size, minimum=1)
    _check_whole_number("data.num_workers", data.num_workers, minimum=0)
    prefetch = data.prefetch_factor
    if prefetch is not None:
        _check_whole_number("data.prefetch_factor", prefetch, minimum=1)
        if data.num_workers == 0:
            raise ConfigError(
                "data.prefetch_factor",
                prefetch,
                "only with data.num_workers > 0 (batches are prefetched by workers)",
                "set data.num_workers or leave data.prefetch_factor=null",
            )
    for key in ("pin_memory", "drop_last", "persistent_workers"):
        if not isinstance(data[key], bool):
            raise ConfigError(f"data.{key}", data[key], "true or false", f"data.{key}=false")


def _check_task_data(cfg: DictConfig) -> None:
    data_name = cfg.data.get("name")
    if data_name not in cfg.task.datasets:
        raise ConfigError(
            "data",
            data_name,
            f"a data set of task={cfg.task.name}: {', '.join(cfg.task.datasets)}",
            f"pick one of those, or a task that reads {data_name}",
        )
    # Building the DataModule reads no data and the module only allocates its weights:
    # both check paths, names and options here, before any worker starts.
    _, module = build_task(cfg)
    logged = getattr(module, "metrics", ())
    check_monitor(cfg.task.get("monitor"), cfg.task.get("monitor_mode"), logged)


def _check_sync_batchnorm(cfg: DictConfig) -> None:
    if cfg.sync_batchnorm and cfg.accelerator != "cuda":
        raise ConfigError(
            "sync_batchnorm",
            True,
            f"SyncBatchNorm needs CUDA devices (accelerator={cfg.accelerator}); torch raises "
            "'SyncBatchNorm layers only work with GPU modules' otherwise",
            "drop sync_batchnorm=true on CPU runs",
        )


def _check_debug(cfg: DictConfig) -> None:
    """The switches of `debug=`: conf/debug/ adds these callbacks and `debug.*` settings."""
    callbacks = cfg.get("callbacks") or {}
    sync_check = callbacks.get("sync_check")
    if sync_check:
        _check_whole_number("callbacks.sync_check.every_n_steps", sync_check.every_n_steps, 1)
    watchdog = callbacks.get("hang_watchdog")
    if watchdog:
        timeout = watchdog.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0:
            raise ConfigError(
                "callbacks.hang_watchdog.timeout_s",
                timeout,
                "seconds > 0 without progress before every rank dumps its stacks",
                "e.g. callbacks.hang_watchdog.timeout_s=300",
            )
        if watchdog.on_hang not in ON_HANG:
            raise ConfigError(
                "callbacks.hang_watchdog.on_hang",
                watchdog.on_hang,
                f"one of {', '.join(ON_HANG)}",
                "callbacks.hang_watchdog.on_hang=exit",
            )
    profiler = callbacks.get("profiler")
    if profiler:
        for key in ("wait", "warmup", "repeat"):
            _check_whole_number(f"callbacks.profiler.{key}", profiler[key], minimum=0)
        active = profiler.active
        if isinstance(active, bool) or not isinstance(active, numbers.Integral) or active < 1:
            raise ConfigError(
                "callbacks.profiler.active",
                active,
                "a whole number >= 1: the profiler records nothing without active steps",
                "e.g. callbacks.profiler.active=3",
            )
    if callbacks.get("host_sync") and cfg.accelerator != "cuda":
        raise ConfigError(
            "debug",
            "host_sync",
            f"only on CUDA devices: it finds where the CPU waits for the GPU, and "
            f"accelerator={cfg.accelerator} has no GPU",
            "run debug=host_sync on a GPU machine (accelerator=cuda)",
        )
    _check_distributed_debug(cfg)


def _check_distributed_debug(cfg: DictConfig) -> None:
    settings = cfg.get("debug") or {}
    entries = settings.get("flight_recorder", 0)
    _check_whole_number("debug.flight_recorder", entries, minimum=0)
    level = settings.get("distributed_debug")
    if level is None:
        return
    if level not in DISTRIBUTED_DEBUG_LEVELS:
        raise ConfigError(
            "debug.distributed_debug",
            level,
            f"one of {', '.join(DISTRIBUTED_DEBUG_LEVELS)} (TORCH_DISTRIBUTED_DEBUG)",
            "debug.distributed_debug=INFO",
        )
    gloo = cfg.strategy.get("process_group_backend") == "gloo" or cfg.accelerator != "cuda"
    if level == "DETAIL" and gloo:
        raise ConfigError(
            "debug.distributed_debug",
            level,
            "INFO or OFF with gloo (CPU): DETAIL crashed DDP's construction on gloo in torch "
            "2.14.1 (pytorch #148976)",
            "debug.distributed_debug=INFO here; DETAIL on GPUs with nccl",
        )


def check_checkpoint_file(path: str) -> None:
    """Exists, and is a complete torch.save archive (a truncated file has no zip directory)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("ckpt_path", path, "an existing checkpoint file", "check the path")
    try:
        with zipfile.ZipFile(file) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        raise ConfigError(
            "ckpt_path",
            path,
            f"a complete Lightning checkpoint; this file cannot be read ({err})",
            "use another checkpoint, e.g. last.ckpt of the run",
        ) from None
    if not any(name.endswith("data.pkl") for name in names):
        raise ConfigError(
            "ckpt_path", path, "a torch.save checkpoint; this archive holds none", "check the path"
        )
