"""A dry run: what a config does at the size it names, before anyone rents that size.

    python train.py debug=dry_run num_nodes=128 devices=8 accelerator=gpu <overrides>

One process plans for every rank. The config is checked as a real start checks it, at the
planned world size (`resolve_and_check`: a batch larger than a rank's shard, an evaluation split
smaller than the ranks, ...), except for what only the planned machines have (the GPUs, the
other nodes). Then torch's fake process group (`backend="fake"`) stands in for the world:
the task's own DataModule deals out the samples of every rank through the project's own
samplers, and the task's own module, wrapped in DistributedDataParallel with the configured
bucket size, takes two real training steps on this machine's CPU, so that DDP forms the
buckets it forms from the second step on and the optimizer holds its state. The fake group
communicates nothing: DDP's backward needs a comm hook whose future is already complete
(the default all-reduce's future has no value there), which here records the buckets.

What it cannot know is said in the report: activation memory (it depends on the GPU's
kernels), a real link's rate (the link is an assumption, `dry_run.link`) and the planned
machines' compute (this CPU's step, or a measured run's, `dry_run.measured_run`).
Figures go to `<run folder>/dry_run.json` and to the console (dry_run_report.py).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, open_dict
from torch.nn.parallel import DistributedDataParallel

from ddp_template.config.dry_run_model import (
    PARAMETER_DTYPE,
    TrainingStep,
    planned_backend,
    tensor_bytes,
    timed_steps,
)
from ddp_template.config.trial_objects import quiet
from ddp_template.errors import ConfigError
from ddp_template.worker.comm_hooks import broadcast_buffer_bytes

DRY_RUN_FILE = "dry_run.json"
CANNOT_KNOW = (
    "activation memory (it depends on the batch, the precision and the GPU's kernels: "
    "measure one step on one planned GPU, callbacks' peak memory in results.json)",
    "a real link's rate and latency (the link figure is an assumption: dry_run.link; "
    "a probe's .json file there is a measurement, of the nodes it was taken on)",
    "the planned machines' compute (the step time uses this machine's CPU step unless "
    "dry_run.measured_run names a run measured on the planned GPU)",
    "the data loading time (no data wait is predicted)",
)


def is_dry_run(cfg: DictConfig) -> bool:
    return bool(cfg.get("dry_run"))


def plan(cfg: DictConfig) -> dict[str, Any]:
    """Checks the config at its planned size, computes every figure, writes dry_run.json
    into the run folder and returns what it wrote. Starts no worker, writes no checkpoint."""
    from ddp_template.build import build_task, world_size
    from ddp_template.config.checks import resolve_and_check

    started = time.perf_counter()
    refuse_unplanned_strategy(cfg)
    apply_global_batch(cfg)
    link = planned_link(cfg)  # a bad dry_run.link is refused before the plan's work
    resolve_and_check(cfg)
    world = world_size(cfg)
    with fake_world(world), quiet():
        torch.manual_seed(int(cfg.seed))
        datamodule, module = build_task(cfg)
        datamodule.setup("fit")
        data = data_figures(datamodule, module, world)
        batch = _first_batch(datamodule, module, world)
        if is_sharded_plan(cfg):
            from ddp_template.config.dry_run_sharded import sharded_model_figures

            model = sharded_model_figures(cfg, module, batch, world)
        else:
            model = model_figures(cfg, module, batch)
    plan = {
        "world_size": world,
        "num_nodes": int(cfg.num_nodes),
        "devices_per_node": int(cfg.devices),
        "accelerator": str(cfg.accelerator),
        "precision": str(cfg.precision),
        "batch": batch_figures(cfg, world),
        "data": data,
        **model,
        "cannot_know": list(CANNOT_KNOW),
    }
    plan["prediction"] = predicted_step(cfg, plan, link)
    plan["seconds"] = round(time.perf_counter() - started, 2)
    from ddp_template.worker.results import write_json_atomic

    write_json_atomic(Path(cfg.paths.output_dir) / DRY_RUN_FILE, plan)
    return plan


# What the dry run plans: DistributedDataParallel (strategy=auto becomes it at > 1 rank),
# and FSDP2 (dry_run_sharded.py).
PLANNED_STRATEGIES = ("auto", "ddp", "ddp_spawn", "fsdp")


def is_sharded_plan(cfg: DictConfig) -> bool:
    return cfg.strategy.get("name") == "fsdp"


def refuse_unplanned_strategy(cfg: DictConfig) -> None:
    name = cfg.strategy.get("name")
    if name not in PLANNED_STRATEGIES:
        raise ConfigError(
            "strategy",
            name,
            f"a strategy the dry run plans: {', '.join(PLANNED_STRATEGIES)} "
            "(DistributedDataParallel's buckets, FSDP's shards, memory and traffic)",
            "strategy=ddp",
        )


def apply_global_batch(cfg: DictConfig) -> None:
    """`dry_run.global_batch_size`: the samples behind one optimizer step over all ranks.
    The per-device batch (`data.batch_size`) follows from it, which the world size and the
    accumulation must divide; the real run is then given that `data.batch_size`."""
    wanted = cfg.dry_run.get("global_batch_size")
    if wanted is None:
        return
    accumulation = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    if isinstance(cfg.num_nodes, int) and isinstance(cfg.devices, int):
        world = cfg.num_nodes * cfg.devices
    else:
        raise ConfigError(
            "dry_run.global_batch_size",
            wanted,
            "a global batch for a world size the command names (devices and num_nodes as "
            f"numbers; here devices={cfg.devices}, num_nodes={cfg.num_nodes})",
            "add devices=<GPUs per node> num_nodes=<nodes>",
        )
    share = world * accumulation
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise ConfigError(
            "dry_run.global_batch_size", wanted, "a whole number >= 1, or null", "e.g. 4096"
        )
    if wanted % share:
        lower, higher = wanted // share * share, (wanted // share + 1) * share
        raise ConfigError(
            "dry_run.global_batch_size",
            wanted,
            f"a multiple of the {world} ranks x {accumulation} accumulated batch(es) = {share}: "
            "every rank takes the same batch",
            f"dry_run.global_batch_size={higher}" + (f" or {lower}" if lower else ""),
        )
    with open_dict(cfg):
        cfg.data.batch_size = wanted // share


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """torch's fake process group of `world` ranks, this process being rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _as_rank(datamodule: Any, module: torch.nn.Module, world: int, rank: int) -> None:
    # The DataModule asks its Trainer for the world and its rank (and for the module, which
    # decides whether a lone last sample is dropped): a stand-in that answers only that.
    datamodule.trainer = SimpleNamespace(
        world_size=world, global_rank=rank, lightning_module=module
    )


def data_figures(datamodule: Any, module: torch.nn.Module, world: int) -> dict[str, Any]:
    """Every rank's loaders as the task's DataModule builds them in a real run: the length
    of each rank's sampler is its shard (counted, not drawn: drawing every rank's order
    would cost a permutation of the whole data set per rank)."""
    train_shards, train_batches, val, test = [], [], [], []
    for rank in range(world):
        _as_rank(datamodule, module, world, rank)
        loader = datamodule.train_dataloader()
        train_shards.append(len(loader.sampler))
        train_batches.append(len(loader))
        val.append(len(datamodule.val_dataloader().sampler))
        test.append(len(datamodule.test_dataloader().sampler))
    datamodule.trainer = None
    samples = len(datamodule.train_set)
    return {
        "train_samples": samples,
        "train_shard_per_rank": train_shards,
        "train_batches_per_rank": train_batches,
        # DistributedSampler pads the epoch to a multiple of the ranks with repeats (or
        # cuts it with drop_last): the difference to the data set, over all ranks.
        "padding": sum(train_shards) - samples,
        "ranks_with_padding": ranks_with_padding(samples, train_shards),
        "val_samples": len(datamodule.val_set),
        "val_per_rank": val,
        "test_samples": len(datamodule.test_set),
        "test_per_rank": test,
    }


def ranks_with_padding(samples: int, shards: list[int]) -> int:
    """Ranks whose last sample is a repeat: rank r takes positions r, r + W, ... of the
    padded order (DistributedSampler), of which those past the data set are repeats."""
    world = len(shards)
    return sum(
        1 for rank, shard in enumerate(shards) if shard and rank + (shard - 1) * world >= samples
    )


def _first_batch(datamodule: Any, module: torch.nn.Module, world: int) -> Any:
    _as_rank(datamodule, module, world, 0)
    batch = next(iter(datamodule.train_dataloader()))
    datamodule.trainer = None
    return batch


class BucketRecorder:
    """A comm hook for the fake process group: records each bucket DDP hands it (index,
    bytes, the shapes of its gradients) and returns a completed future, as DDP needs."""

    def __init__(self) -> None:
        self.buckets: dict[int, dict[str, Any]] = {}
        # DDP reads a hook's names (it refuses bf16 hooks by name without NCCL, and logs it).
        self.__name__ = self.__qualname__ = "record_bucket"

    def __call__(self, state, bucket):
        buffer = bucket.buffer()
        self.buckets[bucket.index()] = {
            "bytes": buffer.numel() * buffer.element_size(),
            "shapes": [list(p.shape) for p in bucket.parameters()],
        }
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future


def ddp_options(cfg: DictConfig) -> dict[str, Any]:
    """The strategy's keys that DistributedDataParallel takes (bucket size, views, ...)."""
    from ddp_template.build import ddp_arguments

    accepted = inspect.signature(DistributedDataParallel).parameters
    # The worker's own translation first (forward_sync_buffers on an older torch).
    options = ddp_arguments({str(key): value for key, value in cfg.strategy.items()})
    return {key: value for key, value in options.items() if key in accepted}


def model_figures(cfg: DictConfig, module: Any, batch: Any) -> dict[str, Any]:
    """Two real training steps of rank 0 under DDP on the fake group: the buckets of the
    second step, the optimizer's state after a step, the checkpoint's size."""
    dtype = PARAMETER_DTYPE.get(str(cfg.precision), torch.float32)
    module.to(dtype)
    batch = [part.to(dtype) if part.is_floating_point() else part for part in batch]
    options = ddp_options(cfg)
    ddp = DistributedDataParallel(TrainingStep(module), **options)
    recorder = BucketRecorder()
    ddp.register_comm_hook(None, recorder)
    # The optimizer alone (resolve_and_check built the scheduler too): its state is the figure.
    optimizer = module.optimizer_factory(module.parameters())
    # The first step (one bucket of everything, then DDP rebuilds them in the order the
    # gradients came) needs no more than two samples; the second, timed, the whole batch.
    times = timed_steps(
        ddp,
        optimizer,
        batch,
        set_to_none=not options.get("gradient_as_bucket_view", False),
        before_each=recorder.buckets.clear,
    )
    buckets = [recorder.buckets[index] for index in sorted(recorder.buckets)]
    trained = [p for p in module.parameters() if p.requires_grad]
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    gradient_bytes = sum(p.numel() * p.element_size() for p in trained)
    bucket_bytes = sum(b["bytes"] for b in buckets)
    views = bool(options.get("gradient_as_bucket_view", False))
    memory = {
        "parameters": parameter_bytes,
        "buffers": sum(b.numel() * b.element_size() for b in module.buffers()),
        # Views into the buckets hold no memory of their own.
        "gradients": 0 if views else gradient_bytes,
        "optimizer_state": tensor_bytes(optimizer.state),
        "buckets": bucket_bytes,
        "comm_hook_state": hook_state_bytes(cfg, buckets),
    }
    memory["total_known"] = sum(memory.values())
    element_bytes = trained[0].element_size() if trained else 4
    return {
        "parameters": sum(p.numel() for p in module.parameters()),
        "element_bytes": element_bytes,
        "ddp": {
            "bucket_cap_mb": options.get("bucket_cap_mb"),
            "gradient_as_bucket_view": views,
            # What DDP itself reports (None: PyTorch's default, 25 MiB).
            "bucket_cap_bytes": int(ddp._get_ddp_logging_data().get("bucket_cap_bytes", 0)),
        },
        "buckets": buckets,
        # Broadcast at every forward's start (strategy.forward_sync_buffers), per dtype.
        "broadcast_buffer_bytes": broadcast_buffer_bytes(ddp),
        "bytes_per_step": bytes_per_step(cfg, buckets, dist.get_world_size(), element_bytes),
        "memory_per_rank": memory,
        "checkpoint_bytes": checkpoint_bytes(module, optimizer),
        "compute_here": {key: round(value, 6) for key, value in times.items()},
    }


def hook_state_bytes(cfg: DictConfig, buckets: list[dict[str, Any]]) -> int:
    """PowerSGD's error feedback: one more copy of every bucket (its default
    use_error_feedback), plus the low-rank factors; the other hooks keep none."""
    if cfg.strategy.get("comm_hook") != "powersgd":
        return 0
    from ddp_template.tools.scaling import sent_bytes

    rank = int(cfg.strategy.get("powersgd_rank") or 1)
    factors = sum(
        sent_bytes(shape, 4, "powersgd", rank)
        for bucket in buckets
        for shape in bucket["shapes"]
        if len(shape) > 1
    )
    return sum(b["bytes"] for b in buckets) + int(factors)


def bytes_per_step(
    cfg: DictConfig, buckets: list[dict[str, Any]], world: int, element_bytes: int
) -> dict[str, Any]:
    """Bytes each rank puts on its link per optimizer step, for every comm hook: a ring
    all-reduce sends 2 (W - 1) / W of what the hook hands it (tools/scaling.py)."""
    from ddp_template.tools.scaling import sent_bytes
    from ddp_template.worker.comm_hooks import COMM_HOOKS, comm_hook

    rank = int(cfg.strategy.get("powersgd_rank") or 1)
    ring = 2 * (world - 1) / world
    per_hook = {}
    for hook in COMM_HOOKS:
        handed = sum(
            sent_bytes(shape, element_bytes, hook, rank)
            for bucket in buckets
            for shape in bucket["shapes"]
        )
        per_hook[hook] = {
            "all_reduced": int(handed),
            "sent_per_rank": int(ring * handed),
            "all_reduces": len(buckets) * comm_hook(hook).all_reduces,
        }
    return {
        "configured_hook": str(cfg.strategy.get("comm_hook") or "none"),
        "ring_factor": ring,
        "per_hook": per_hook,
    }


def checkpoint_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The weights and optimizer state as Lightning's checkpoint holds them, serialised in
    memory (nothing is written)."""
    buffer = io.BytesIO()
    torch.save(
        {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}, buffer
    )
    return buffer.getbuffer().nbytes


def batch_figures(cfg: DictConfig, world: int) -> dict[str, Any]:
    from ddp_template.launch.topology import global_batch_size

    per_rank = int(cfg.data.batch_size)
    accumulation = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    return {
        "per_rank": per_rank,
        "accumulate_grad_batches": accumulation,
        "global": global_batch_size(per_rank, world, accumulation),
    }


def planned_link(cfg: DictConfig) -> Any:
    """`dry_run.link`: a rate per node, or a probe's .json file measured on the nodes."""
    from ddp_template.tools.scaling import link_of

    latency_s = float(cfg.dry_run.get("latency_us", 50)) * 1e-6
    return link_of(str(cfg.dry_run.get("link")), latency_s, "dry_run.link")


def predicted_step(cfg: DictConfig, plan: dict[str, Any], link: Any) -> dict[str, Any]:
    """The scaling model's step time at the planned nodes for each hook, on `link`
    (`planned_link`); the compute is this CPU's step or a measured run's."""
    from ddp_template.tools.scaling import (
        MeasuredRun,
        load_run,
        predict,
        probe_hook_costs,
    )
    from ddp_template.worker.comm_hooks import COMM_HOOKS

    link_text = str(cfg.dry_run.get("link"))
    latency_s = float(cfg.dry_run.get("latency_us", 50)) * 1e-6
    shapes = [shape for bucket in plan.get("buckets", []) for shape in bucket["shapes"]]
    measured_folder = cfg.dry_run.get("measured_run")
    if measured_folder:
        measured = load_run(Path(str(measured_folder)))
        run = replace(measured, devices_per_node=int(cfg.devices), nodes=1)
        compute_from = f"{measured_folder} (measured)"
    else:
        here = plan["compute_here"]
        run = MeasuredRun(
            step_s=here["forward_s"] + here["backward_s"] + here["rest_s"],
            data_wait_s=0.0,
            forward_s=here["forward_s"],
            backward_s=here["backward_s"],
            shapes=shapes,
            element_bytes=int(plan["element_bytes"]),
            samples_per_step_per_device=plan["batch"]["per_rank"]
            * plan["batch"]["accumulate_grad_batches"],
            devices_per_node=int(cfg.devices),
            nodes=1,
            bucket_cap_mb=cfg.strategy.get("bucket_cap_mb"),
            threads=torch.get_num_threads(),
            powersgd_rank=int(cfg.strategy.get("powersgd_rank") or 1),
            backend=planned_backend(cfg),
            broadcast_buffer_bytes=dict(plan.get("broadcast_buffer_bytes") or {}),
        )
        compute_from = "this machine's CPU, one step of rank 0 (not the planned machines)"
    nodes = int(cfg.num_nodes)
    assumed = (
        f"measured by the probe in {link_text}: {link.describe()}"
        if link_text.endswith(".json")
        else f"{link_text} per node, {latency_s * 1e6:g} us per ring hop "
        "(an assumption: dry_run.link)"
    )
    if "sharding" in plan:
        from ddp_template.tools.scaling import predict_sharded

        sharding = plan["sharding"]
        sharded = predict_sharded(
            run, nodes, link, sharding["units"], sharding["reshard_after_forward"]
        )
        return {
            "link": assumed,
            "compute_from": compute_from,
            "configured_hook": "none",
            "per_hook": {"fsdp": asdict(sharded)},
        }
    costs = probe_hook_costs(run, list(COMM_HOOKS))
    per_hook = {
        hook: asdict(
            predict(run, nodes, hook, link, costs[hook], cfg.strategy.get("bucket_cap_mb"))
        )
        for hook in COMM_HOOKS
    }
    return {
        "link": assumed,
        "compute_from": compute_from,
        "configured_hook": str(cfg.strategy.get("comm_hook") or "none"),
        "per_hook": per_hook,
    }
