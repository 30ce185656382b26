"""Every value a run depends on, checked before any worker process starts.

`check_config` resolves the values that depend on the machine (accelerator, devices) in
place, so that every worker reads the same concrete config; checks types and ranges against
the schema (`schema.py`); checks what needs context (GPUs, launchers, files, servers); and
last builds the real objects once, so that whatever a library refuses is refused here.
Each refusal is a `ConfigError` with the key, the bad value, what is allowed and the fix.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from ddp_template.build_check import check_by_building
from ddp_template.callbacks.progress import check_progress
from ddp_template.checkpoint_check import check_checkpoint
from ddp_template.compiling import check_compile
from ddp_template.errors import ConfigError
from ddp_template.launch import processes_started_externally
from ddp_template.network import check_rendezvous_host
from ddp_template.schema import TRAINER_ARGS_ELSEWHERE, check_types_and_ranges
from ddp_template.trackers import check_trackers
from ddp_template.world import check_restarts, take_launched_world

__all__ = ["TRAINER_ARGS_ELSEWHERE", "check_checkpoint_file", "check_config"]
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def check_config(cfg: DictConfig) -> None:
    with open_dict(cfg):
        cfg.accelerator = _resolve_accelerator(cfg.accelerator)
        cfg.devices, cfg.num_nodes = take_launched_world(cfg.devices, cfg.num_nodes)
        cfg.devices = _resolve_devices(cfg.devices, cfg.accelerator)
    check_types_and_ranges(cfg)
    check_restarts(cfg.max_restarts, cfg.strategy.name, cfg.devices)
    _check_launch(cfg)
    _check_devices_support(cfg)
    _check_distributed_debug(cfg)
    _check_task_data(cfg)
    _check_prefetch(cfg.data)
    check_trackers(cfg)
    check_compile(cfg)
    check_progress(cfg)
    if cfg.ckpt_path is not None:
        check_checkpoint_file(cfg.ckpt_path)
    check_by_building(cfg)
    check_checkpoint(cfg)


def _resolve_accelerator(value: object) -> str:
    if value not in ACCELERATORS:
        raise ConfigError(
            "accelerator", value, f"one of {', '.join(ACCELERATORS)}", "e.g. accelerator=cpu"
        )
    # Lightning makes these counts NVML-based: no CUDA context in this process, which
    # could not be used by workers forked from it.
    if value == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if value in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            "accelerator", value, "a GPU, and torch sees none on this machine", "accelerator=cpu"
        )
    return "cuda" if value == "gpu" else str(value)


def _resolve_devices(value: object, accelerator: str) -> int:
    if value == "auto":
        return torch.cuda.device_count() if accelerator == "cuda" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("devices", value, "a whole number >= 1 or 'auto'", "e.g. devices=1")
    if accelerator == "cuda" and value > torch.cuda.device_count():
        raise ConfigError(
            "devices",
            value,
            f"at most the {torch.cuda.device_count()} GPUs visible here",
            "lower devices or use more nodes",
        )
    return value


def _check_launch(cfg: DictConfig) -> None:
    if cfg.num_nodes == 1 or processes_started_externally():
        return
    network = cfg.network
    if network.master_addr is None or network.node_rank is None:
        raise ConfigError(
            "num_nodes",
            cfg.num_nodes,
            "1 for the plain command, unless every node is started with its network.node_rank "
            "and node 0's network.master_addr",
            f"on each node: python train.py num_nodes={cfg.num_nodes} network.node_rank=<0..."
            f"{cfg.num_nodes - 1}> network.master_addr=<node 0's address> network.job_id=<name> "
            "(or start every node with torchrun or srun, docs/nodes.md)",
        )
    if network.node_rank >= cfg.num_nodes:
        raise ConfigError(
            "network.node_rank",
            network.node_rank,
            f"0 to {cfg.num_nodes - 1} for num_nodes={cfg.num_nodes}",
            "give each node its own number, 0 on the one that hosts the rendezvous",
        )
    if cfg.strategy.name == "ddp_spawn":
        raise ConfigError("strategy", "ddp_spawn", "ddp on several nodes", "use strategy=ddp")
    check_rendezvous_host(
        network.master_addr, network.master_port, network.node_rank, network.timeout_s
    )


def _check_devices_support(cfg: DictConfig) -> None:
    """What only CUDA devices run (each would fail in every worker, or only on GPUs)."""
    if cfg.accelerator == "cuda":
        if cfg.strategy.get("comm_hook") == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError(
                "strategy.comm_hook",
                "bf16",
                "bf16 compression needs a GPU with bfloat16 support (Ampere or newer)",
                "use strategy.comm_hook=fp16",
            )
        return
    refused = [
        ("strategy.process_group_backend", "nccl", "use gloo (or null) on CPUs"),
        ("sync_batchnorm", True, "drop sync_batchnorm=true on CPU runs"),
    ]
    if (cfg.get("callbacks") or {}).get("host_sync"):
        refused.append(("debug", "host_sync", "run debug=host_sync on a GPU machine"))
    for key, value, fix in refused:
        if key == "debug" or OmegaConf.select(cfg, key) == value:
            raise ConfigError(key, value, f"only on CUDA, and accelerator={cfg.accelerator}", fix)


def _check_distributed_debug(cfg: DictConfig) -> None:
    gloo = cfg.accelerator != "cuda" or cfg.strategy.get("process_group_backend") == "gloo"
    if gloo and (cfg.get("debug") or {}).get("distributed_debug") == "DETAIL":
        raise ConfigError(
            "debug.distributed_debug",
            "DETAIL",
            "INFO or OFF with gloo (CPU): DETAIL crashed DDP's construction on gloo in torch "
            "2.14.1 (pytorch #148976)",
            "debug.distributed_debug=INFO here; DETAIL on GPUs with nccl",
        )


def _check_task_data(cfg: DictConfig) -> None:
    data_name = cfg.data.get("name")
    if data_name not in cfg.task.datasets:
        raise ConfigError(
            "data",
            data_name,
            f"a data set of task={cfg.task.name}: {', '.join(cfg.task.datasets)}",
            f"pick one of those, or a task that reads {data_name}",
        )


def _check_prefetch(data: DictConfig) -> None:
    if data.get("prefetch_factor") is not None and data.num_workers == 0:
        raise ConfigError(
            "data.prefetch_factor",
            data.prefetch_factor,
            "only with data.num_workers > 0 (batches are prefetched by workers)",
            "set data.num_workers or leave data.prefetch_factor=null",
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
