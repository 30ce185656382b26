"""Every value a run depends on, checked before any worker process starts.

`resolve_and_check` resolves the values that depend on the machine (accelerator, devices) in
place, so that every worker reads the same concrete config; checks types and ranges against
the schema (`schema.py`); checks what needs context (GPUs, launchers, files, servers); and
last builds the real objects once, so that whatever a library refuses is refused here.
Each refusal is a `ConfigError` with the key, the bad value, what is allowed and the fix.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from ddp_template.build import build_task
from ddp_template.callbacks.progress import check_progress
from ddp_template.config.schema import TRAINER_ARGS_ELSEWHERE, check_types_and_ranges
from ddp_template.config.sharding_check import check_sharding
from ddp_template.config.trial_objects import check_by_building
from ddp_template.errors import ConfigError
from ddp_template.launch import starters
from ddp_template.launch.agent import processes_started_externally
from ddp_template.launch.cuda_devices import (
    VISIBLE,
    compute_capabilities,
    lists_mig,
    visible_devices,
)
from ddp_template.launch.network import check_rendezvous_host
from ddp_template.launch.world import check_restarts, take_launched_world
from ddp_template.resume.checkpoint_check import check_checkpoint
from ddp_template.worker.comm_hooks import bf16_refused
from ddp_template.worker.compiling import check_compile
from ddp_template.worker.trackers import check_trackers

__all__ = ["TRAINER_ARGS_ELSEWHERE", "resolve_and_check"]
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def resolve_and_check(cfg: DictConfig) -> None:
    """Resolves, in `cfg`, what depends on the machine and the starter (accelerator,
    devices, num_nodes), then checks every value before any worker starts: one paragraph
    (ConfigError) for the first that cannot work."""
    # A dry run (debug=dry_run) plans for machines this one is not: their GPUs and the
    # other nodes are taken as the config names them; everything else is checked alike.
    planned = bool(cfg.get("dry_run"))
    with open_dict(cfg):
        if planned:
            cfg.accelerator, cfg.devices = planned_machine(cfg.accelerator, cfg.devices)
        else:
            cfg.accelerator = resolve_accelerator(cfg.accelerator)
        cfg.devices, cfg.num_nodes = take_launched_world(cfg.devices, cfg.num_nodes)
        if not planned:
            cfg.devices = resolve_devices(cfg.devices, cfg.accelerator)
    check_types_and_ranges(cfg)
    check_restarts(cfg.max_restarts, cfg.strategy.name, cfg.devices)
    if not planned:
        _check_launch(cfg)
    check_sharding(cfg)
    if not (planned and cfg.accelerator == "cuda"):
        _check_devices_support(cfg)
    _check_distributed_debug(cfg)
    _check_prefetch(cfg.data)
    check_trackers(cfg)
    check_compile(cfg)
    check_progress(cfg)
    check_by_building(cfg)
    check_checkpoint(cfg, lambda checked: build_task(checked)[1])


def resolve_accelerator(value: object) -> str:
    """`auto`, `gpu` -> the accelerator the workers use; a GPU asked where none is visible
    is refused, naming the launcher that started this process without one."""
    if value not in ACCELERATORS:
        raise ConfigError(
            "accelerator", value, f"one of {', '.join(ACCELERATORS)}", "e.g. accelerator=cpu"
        )
    # Counted through NVML where it can (no CUDA context); see cuda_devices.
    if value == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if value in ("gpu", "cuda") and not torch.cuda.is_available():
        starter = starters.current()
        if starter is None:
            raise ConfigError(
                "accelerator",
                value,
                "a GPU, and torch sees none on this machine",
                "accelerator=cpu",
            )
        listed = os.environ.get(VISIBLE)
        shown = "unset" if listed is None else repr(listed)
        raise ConfigError(
            "accelerator",
            value,
            f"a GPU for this process, and {starter.name} started it without one "
            f"(CUDA_VISIBLE_DEVICES {shown}, torch sees no GPU)",
            f"{starter.gpu_request}; or accelerator=cpu",
        )
    return "cuda" if value == "gpu" else str(value)


def planned_machine(accelerator: object, devices: object) -> tuple[str, object]:
    """A dry run's accelerator and devices per node: the planned machine's, whatever this
    one has (`auto` still means this machine)."""
    if accelerator in ("gpu", "cuda"):
        if devices == "auto":
            raise ConfigError(
                "devices",
                devices,
                "the number of GPUs per node in a dry run (it plans for GPUs this machine "
                "does not have, so it cannot count them)",
                "e.g. devices=8",
            )
        return "cuda", devices
    resolved = resolve_accelerator(accelerator)
    return resolved, resolve_devices(devices, resolved) if devices == "auto" else devices


def resolve_devices(value: object, accelerator: str) -> int:
    """`auto` -> every visible GPU (1 on other accelerators); a number the GPUs cannot hold
    is refused: more than CUDA_VISIBLE_DEVICES lists, or than are visible, or several on a
    MIG instance."""
    if value == "auto":
        return torch.cuda.device_count() if accelerator == "cuda" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("devices", value, "a whole number >= 1 or 'auto'", "e.g. devices=1")
    if accelerator != "cuda":
        return value
    listed = visible_devices()
    if value > 1 and lists_mig():
        raise ConfigError(
            "devices",
            value,
            f"1 on a MIG instance: CUDA_VISIBLE_DEVICES={os.environ[VISIBLE]} names MIG "
            "instances, and a CUDA process sees only the first of them (NVIDIA's MIG user "
            "guide), so one process cannot train on several",
            "devices=1, or whole GPUs (CUDA_VISIBLE_DEVICES=0,1) for data-parallel training",
        )
    if listed is not None and value > len(listed):
        launcher = starters.started_by()
        fix = (
            f"devices={len(listed)} or fewer, or list more GPUs in CUDA_VISIBLE_DEVICES"
            if launcher is None
            # Each rank takes the GPU of its local rank among those it sees.
            else f"let {launcher} show every process all {value} GPUs of its node (srun: "
            "--gpus-per-node rather than --gpus-per-task=1)"
        )
        raise ConfigError(
            "devices",
            value,
            f"at most the {len(listed)} GPUs CUDA_VISIBLE_DEVICES={os.environ[VISIBLE]!r} lists",
            fix,
        )
    if value > torch.cuda.device_count():
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
        if cfg.strategy.get("comm_hook") == "bf16":
            # Asked of NVML: torch would create a CUDA context here. Where NVML cannot
            # tell, each worker checks its own GPU (comm_hooks.check_bf16_support).
            capabilities = compute_capabilities()
            if capabilities is not None and capabilities and min(capabilities)[0] < 8:
                raise bf16_refused(min(capabilities))
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


def _check_prefetch(data: DictConfig) -> None:
    if data.get("prefetch_factor") is not None and data.num_workers == 0:
        raise ConfigError(
            "data.prefetch_factor",
            data.prefetch_factor,
            "only with data.num_workers > 0 (batches are prefetched by workers)",
            "set data.num_workers or leave data.prefetch_factor=null",
        )
