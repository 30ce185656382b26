"""The dry run of `strategy=fsdp` (dry_run.py plans `ddp`): FSDP2's `fully_shard` on torch's
fake process group, the units the config wraps, two real training steps of rank 0.

What differs from DDP's plan: each rank holds 1/W of the parameters, gradients and optimizer
state, rounded up per parameter (FSDP2 splits each parameter's first dimension into W chunks
of ceil(rows / W); rank 0 always holds a full chunk, so its share is the largest and is the
figure shown; a 64-row weight over 1,024 ranks is one row on rank 0 and none on rank 517).
On top of the shard, a rank holds the units it has gathered for the compute: the root's
parameters from the forward to the backward, a unit while it computes and the next one
prefetched. The traffic is all-gathers in the forward (every unit), again in the backward
(the units resharded after their forward) and reduce-scatters of the gradients; a ring
all-gather or reduce-scatter sends (W - 1) / W of the gathered bytes per rank.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from omegaconf import DictConfig
from torch import nn

from ddp_template.config.dry_run_model import (
    PARAMETER_DTYPE,
    TrainingStep,
    planned_backend,
    tensor_bytes,
    timed_steps,
)
from ddp_template.worker.sharding import ShardingOptions, shard_network, units_to_wrap


def unit_bytes(network: nn.Module, options: ShardingOptions) -> list[dict[str, Any]]:
    """The bytes each unit gathers, in the order the forward reaches them, the root (the
    parameters no unit took) first: FSDP2 gives each unit what no unit inside it holds."""
    order = {id(m): i for i, m in enumerate(network.modules())}
    taken: set[int] = set()
    units: list[dict[str, Any]] = []
    for unit in units_to_wrap(network, options.wrap):
        own = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        units.append(
            {
                "name": type(unit).__name__,
                "position": order[id(unit)],
                "bytes": sum(p.numel() * p.element_size() for p in own),
            }
        )
    units.sort(key=lambda unit: unit["position"])
    root = sum(p.numel() * p.element_size() for p in network.parameters() if id(p) not in taken)
    return [{"name": "root", "bytes": root}] + [
        {"name": u["name"], "bytes": u["bytes"]} for u in units
    ]


def sharded_model_figures(cfg: DictConfig, module: Any, batch: Any, world: int) -> dict[str, Any]:
    """The plan's model part under FSDP2 (the same keys as DDP's where they mean the same)."""
    from torch.distributed.device_mesh import init_device_mesh

    dtype = PARAMETER_DTYPE.get(str(cfg.precision), torch.float32)
    module.to(dtype)
    batch = [part.to(dtype) if part.is_floating_point() else part for part in batch]
    options = ShardingOptions.of(cfg.strategy)
    network = module.model
    units = unit_bytes(network, options)
    parameters = sum(p.numel() for p in module.parameters())
    element_bytes = next(module.parameters()).element_size()
    shard_network(network, init_device_mesh("cpu", (world,)), options)
    optimizer = module.optimizer_factory(module.parameters())
    times = timed_steps(TrainingStep(module), optimizer, batch)
    shard = sum(_local_bytes(p) for p in module.parameters())
    trained = sum(_local_bytes(p) for p in module.parameters() if p.requires_grad)
    memory = {
        "parameters": shard,
        "buffers": sum(b.numel() * b.element_size() for b in module.buffers()),
        "gradients": trained,
        "optimizer_state": tensor_bytes(optimizer.state, _local_bytes),
        "gathered_units": gathered_peak(units, options.reshard_after_forward),
    }
    memory["total_known"] = sum(memory.values())
    return {
        "parameters": parameters,
        "element_bytes": element_bytes,
        "sharding": {
            "wrap": None if options.wrap is None else list(options.wrap),
            "reshard_after_forward": options.reshard_after_forward,
            "units": units,
            "unsharded_parameter_bytes": sum(u["bytes"] for u in units),
        },
        "bytes_per_step": sharded_traffic(
            units, world, options.reshard_after_forward, planned_backend(cfg)
        ),
        "memory_per_rank": memory,
        # The whole model and optimizer state over all ranks (a DTensor's size is global).
        "checkpoint_bytes": tensor_bytes(module.state_dict()) + tensor_bytes(optimizer.state),
        "compute_here": {key: round(value, 6) for key, value in times.items()},
    }


def gathered_peak(units: list[dict[str, Any]], reshard_after_forward: bool) -> int:
    """The gathered parameters a rank holds at once, beyond its shard: the root's (kept from
    the forward to the backward), then either every unit (none resharded after its forward)
    or the two largest (one computing, the next prefetched)."""
    root, rest = units[0]["bytes"], sorted((u["bytes"] for u in units[1:]), reverse=True)
    return root + (sum(rest[:2]) if reshard_after_forward else sum(rest))


def sharded_traffic(
    units: list[dict[str, Any]], world: int, reshard_after_forward: bool, backend: str
) -> dict[str, Any]:
    """Bytes each rank sends per optimizer step and the collectives behind them (on gloo
    the reduce-scatter is an all-reduce of the whole unit: `reduce_scatter_factor`)."""
    from ddp_template.tools.scaling import reduce_scatter_factor

    ring, scatter = (world - 1) / world, reduce_scatter_factor(backend, world)
    everything = sum(u["bytes"] for u in units)
    regathered = sum(u["bytes"] for u in units[1:]) if reshard_after_forward else 0
    holding = sum(1 for u in units if u["bytes"])
    resharded = sum(1 for u in units[1:] if u["bytes"]) if reshard_after_forward else 0
    collectives = {
        "forward_all_gather": {"bytes": everything, "count": holding},
        "backward_all_gather": {"bytes": regathered, "count": resharded},
        "reduce_scatter": {"bytes": everything, "count": holding},
    }
    for name, figures in collectives.items():
        factor = scatter if name == "reduce_scatter" else ring
        figures["sent_per_rank"] = int(factor * figures["bytes"])
    return {
        "configured_hook": "none",
        "backend": backend,
        "ring_factor": ring,
        "reduce_scatter_factor": scatter,
        "collectives": collectives,
        "sent_per_rank": sum(f["sent_per_rank"] for f in collectives.values()),
        # What DDP's ring all-reduce of the same gradients would send, for comparison.
        "ddp_sent_per_rank": int(2 * ring * everything),
    }


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return cast(torch.Tensor, local).numel() * tensor.element_size()
