"""The dry run's figures (dry_run.py) as the table the console shows."""

from __future__ import annotations

import statistics
from typing import Any


def size(nbytes: float) -> str:
    """Bytes in the binary unit that reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def spread(values: list[int]) -> str:
    """min / median / max over the ranks: one line whatever the world size."""
    if not values:
        return "none"
    low, high = min(values), max(values)
    if low == high:
        return f"{low} on every rank"
    return f"min {low}, median {statistics.median(values):g}, max {high}"


def report_lines(plan: dict[str, Any], written: str) -> list[str]:
    data, batch, memory = plan["data"], plan["batch"], plan["memory_per_rank"]
    world = plan["world_size"]
    rows = [
        (
            "world",
            f"{plan['num_nodes']} node(s) x {plan['devices_per_node']} device(s) = {world} "
            f"ranks, accelerator {plan['accelerator']}, precision {plan['precision']}",
        ),
        (
            "batch",
            f"{batch['per_rank']} per rank, {batch['accumulate_grad_batches']} accumulated, "
            f"global {batch['global']} (= {batch['per_rank']} x {world} ranks x "
            f"{batch['accumulate_grad_batches']})",
        ),
        (
            "training shard",
            f"{spread(data['train_shard_per_rank'])} samples of {data['train_samples']}; "
            + _padding(data)
            + f"; batches per rank: {spread(data['train_batches_per_rank'])}",
        ),
        (
            "validation",
            f"{spread(data['val_per_rank'])} samples per rank of {data['val_samples']} (unpadded)",
        ),
        (
            "test",
            f"{spread(data['test_per_rank'])} samples per rank of {data['test_samples']} "
            "(unpadded)",
        ),
        ("model", f"{plan['parameters']:,} parameters, {plan['element_bytes']} bytes each"),
        *(_sharded_rows(plan) if "sharding" in plan else _ddp_rows(plan)),
        (
            "memory per rank",
            ", ".join(
                f"{name.replace('_', ' ')} {size(value)}"
                for name, value in memory.items()
                if name != "total_known"
            )
            + f"; total {size(memory['total_known'])} without activations",
        ),
        ("checkpoint", f"{size(plan['checkpoint_bytes'])} (weights and optimizer state)"),
        *_prediction(plan["prediction"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"dry run: {world} ranks planned in {plan['seconds']:.1f} s in this one process "
        "(torch's fake process group): no worker started, nothing trained, no checkpoint"
    ]
    lines += [f"  {name:<{width}}  {text}" for name, text in rows]
    lines.append("  not known to a dry run:")
    lines += [f"    - {item}" for item in plan["cannot_know"]]
    lines.append(f"  written: {written}")
    return lines


def _ddp_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    return [("buckets", _buckets(plan)), ("bytes per step", _traffic(plan))]


def _sharded_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """FSDP's units and collectives (dry_run_sharded.py)."""
    sharding, traffic = plan["sharding"], plan["bytes_per_step"]
    units = sharding["units"]
    shown = ", ".join(f"{u['name']} {size(u['bytes'])}" for u in units[:6])
    wrap = ", ".join(sharding["wrap"] or []) or "every child of the network that holds parameters"
    collectives = "; ".join(
        f"{name.replace('_', ' ')} {size(c['sent_per_rank'])} in {c['count']}"
        for name, c in traffic["collectives"].items()
    )
    return [
        (
            "sharding",
            f"{len(units) - 1} unit(s) ({wrap}) and the root, "
            f"{size(sharding['unsharded_parameter_bytes'])} gathered in all: {shown}"
            + (", ..." if len(units) > 6 else "")
            + f"; reshard after forward: {str(sharding['reshard_after_forward']).lower()}",
        ),
        (
            "bytes per step",
            f"{size(traffic['sent_per_rank'])} sent per rank: {collectives} "
            f"(ring: {traffic['ring_factor']:.4f} x the gathered bytes"
            + (
                f"; {traffic['backend']} reduce-scatters as an all-reduce: "
                f"{traffic['reduce_scatter_factor']:.4f} x"
                if traffic["reduce_scatter_factor"] != traffic["ring_factor"]
                else ""
            )
            + "); DDP's all-reduce of "
            f"the same gradients: {size(traffic['ddp_sent_per_rank'])}",
        ),
    ]


def _padding(data: dict[str, Any]) -> str:
    padding = data["padding"]
    if padding > 0:
        return (
            f"padding {padding} repeated sample(s) (DistributedSampler), the last sample of "
            f"{data['ranks_with_padding']} rank(s)"
        )
    if padding < 0:
        return f"{-padding} sample(s) left out by drop_last"
    return "no padding"


def _buckets(plan: dict[str, Any]) -> str:
    buckets, ddp = plan["buckets"], plan["ddp"]
    sizes = [b["bytes"] for b in buckets]
    cap = ddp["bucket_cap_mb"]
    shown = ", ".join(size(s) for s in sizes[:6]) + (", ..." if len(sizes) > 6 else "")
    return (
        f"{len(buckets)} bucket(s) of DDP's second step (bucket_cap_mb="
        f"{'null: 25 MiB' if cap is None else cap}), {size(sum(sizes))} in all: {shown}"
    )


def _traffic(plan: dict[str, Any]) -> str:
    traffic = plan["bytes_per_step"]
    parts = []
    for hook, figures in traffic["per_hook"].items():
        mark = " (configured)" if hook == traffic["configured_hook"] else ""
        parts.append(
            f"{hook}{mark} {size(figures['sent_per_rank'])} sent per rank in "
            f"{figures['all_reduces']} all-reduce(s)"
        )
    text = "; ".join(parts) + f" (ring: {traffic['ring_factor']:.4f} x the bucket bytes)"
    buffers = plan.get("broadcast_buffer_bytes") or {}
    if buffers:
        text += (
            f"; and the buffers, {size(sum(buffers.values()))} broadcast from rank 0 at each "
            "forward (strategy.forward_sync_buffers)"
        )
    return text


def _of_which_buffers(p: dict[str, Any]) -> str:
    seconds = p.get("buffer_broadcast_s") or 0.0
    return f", of which the buffer broadcast {seconds:.4f} s" if seconds else ""


def _prediction(prediction: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("predicted step", f"link {prediction['link']}; compute from {prediction['compute_from']}")
    ]
    for hook, p in prediction["per_hook"].items():
        mark = " (configured)" if hook == prediction["configured_hook"] else ""
        rows.append(
            (
                f"  {hook}{mark}",
                f"{p['step_s']:.4f} s (compute {p['compute_s']:.4f} s, exposed communication "
                f"{p['exposed_comm_s']:.4f} s{_of_which_buffers(p)}), scaling efficiency "
                f"{p['efficiency']:.0%}",
            )
        )
    return rows
