"""`strategy=fsdp`: parameters, gradients and optimizer state sharded over the ranks
(FSDP2, `torch.distributed.fsdp.fully_shard`), through Lightning's `ModelParallelStrategy`.

Why that strategy: Lightning's `FSDPStrategy` wraps FSDP1 and refuses the CPU, while
`ModelParallelStrategy` runs FSDP2 on any device (gloo included), saves each rank's shard
with torch's distributed checkpoint (DCP) and loads a checkpoint saved at another world
size, or a plain one-file checkpoint of `ddp`. It leaves the wrapping to the module's
`configure_model`; `TaskModule.configure_model` hands the task's network to
`ShardedStrategy.shard`, so every task, a user's included, is sharded the same way.

What this module adds to Lightning's:
- the wrapping the config asks for (`strategy.wrap`: modules by class name, each
  all-gathered on its own; reshard-after-forward; activation checkpointing; CPU offload);
- the nodes' check of `node_agreement.start_process_group` before the process group of a job
  of several nodes, as `ddp` has;
- sharded checkpoints that cannot be torn: written to a hidden folder beside the final one
  and renamed, the previous `last.ckpt` kept as `last.prev.ckpt` until then (the guarantee
  `checkpoint_io.SafeCheckpointIO` gives one-file checkpoints);
- optionally asynchronous saves (`torch.distributed.checkpoint.async_save`): training waits
  only for the copy of its shard, the write and the rename finish in the background;
- the time training was blocked by each save (`checkpoint_blocked_s`, results.json).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.constants import default_pg_timeout

from ddp_template.project import LAST, previous_of

# Lightning's precisions for ModelParallelStrategy (its accelerator connector refuses others).
FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
# DCP's own file in a complete checkpoint folder, written last by the coordinating rank.
DCP_METADATA = ".metadata"
# Lightning's file of everything that is not weights or optimizer state (loops, callbacks).
LIGHTNING_METADATA = _METADATA_FILENAME


@dataclass(frozen=True)
class ShardingOptions:
    """The `strategy.*` keys of `conf/strategy/fsdp.yaml` that shape the wrapping."""

    # Class names of the modules sharded as units (each all-gathered on its own); None:
    # every child of the network that holds parameters.
    wrap: tuple[str, ...] | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False

    @classmethod
    def of(cls, strategy: Any) -> ShardingOptions:
        """From the strategy's config (`cfg.strategy`, or its keys as a dict)."""
        wrap = strategy.get("wrap")
        return cls(
            wrap=None if wrap is None else tuple(wrap),
            reshard_after_forward=bool(strategy.get("reshard_after_forward", True)),
            activation_checkpointing=bool(strategy.get("activation_checkpointing", False)),
            cpu_offload=bool(strategy.get("cpu_offload", False)),
        )


def units_to_wrap(network: nn.Module, wrap: tuple[str, ...] | None) -> list[nn.Module]:
    """The modules sharded as units, inner ones before the modules that hold them (FSDP2
    gives each unit the parameters no unit inside it took, so the inner must come first)."""
    if wrap is None:
        return [child for child in network.children() if any(True for _ in child.parameters())]
    names = set(wrap)
    return [
        module
        for module in reversed(list(network.modules())[1:])
        if type(module).__name__ in names and any(True for _ in module.parameters())
    ]


def missing_classes(network: nn.Module, wrap: tuple[str, ...] | None) -> list[str]:
    """The class names of `wrap` no module of the network (with parameters) has."""
    if wrap is None:
        return []
    present = {type(m).__name__ for m in network.modules() if any(True for _ in m.parameters())}
    return [name for name in wrap if name not in present]


def shard_network(network: nn.Module, mesh: Any, options: ShardingOptions) -> None:
    """Wraps the chosen units, then the network (the parameters no unit holds)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()
    units = units_to_wrap(network, options.wrap)
    for unit in units:
        if options.activation_checkpointing:
            # Recomputes the unit's activations in the backward instead of keeping them.
            checkpoint(unit)
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            offload_policy=offload,
        )
    # The root's parameters are all-gathered for the backward anyway: keeping them saves
    # one all-gather (PyTorch's advice for the root).
    fully_shard(network, mesh=mesh, reshard_after_forward=False, offload_policy=offload)
    if mesh.device_type == "cpu":
        from ddp_template.worker.comm_clock import clock_collectives

        # The step's exposed communication (results.json: exposed_comm_s).
        clock_collectives([*units, network])


def is_sharded(network: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(network, FSDPModule)


def bare_state_dict(network: nn.Module) -> dict[str, torch.Tensor]:
    """The network's plain state_dict on the CPU, the same whatever the strategy. A sharded
    one is gathered (a collective: every rank calls this; rank 0 gets the full dict, the
    others an empty one)."""
    if not is_sharded(network):
        return {key: value.detach().cpu() for key, value in network.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast("dict[str, torch.Tensor]", get_model_state_dict(network, options=options))


class ShardedStrategy(ModelParallelStrategy):
    """Every rank one shard of the data-parallel mesh (no tensor parallelism)."""

    def __init__(
        self,
        world_size: int,
        sharding: ShardingOptions,
        node_config: dict[str, Any] | None = None,
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(
            data_parallel_size=world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout or default_pg_timeout,
        )
        self.sharding = sharding
        self.node_config = node_config or {}
        self.async_save = async_save
        # Seconds each save held training up (results.json: checkpoint_blocked_s).
        self.checkpoint_blocked_s: list[float] = []
        self._pending: tuple[Any, Path, Path] | None = None
        self._checkpoint_group: Any = None

    def shard(self, network: nn.Module) -> None:
        """Called by `TaskModule.configure_model`, again for every fit and test: once."""
        if not is_sharded(network):
            from ddp_template.worker.flops import remember_unsharded

            remember_unsharded(network)
            shard_network(network, self.device_mesh["data_parallel"], self.sharding)

    def _setup_distributed(self) -> None:
        from ddp_template.worker.node_agreement import start_checked_process_group

        start_checked_process_group(self, self.node_config)
        super()._setup_distributed()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        self.finish_pending_save()
        final = Path(self.broadcast(str(filepath)))
        temporary = final.with_name(f".{final.name}.tmp")
        if self.is_global_zero:
            # What an attempt killed while writing left behind.
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
        self.barrier()
        state = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{index}"] = optimizer_state
        if self.is_global_zero:
            torch.save(checkpoint, temporary / LIGHTNING_METADATA)
        if self.async_save:
            if self._checkpoint_group is None:
                # The background write's collectives on a group of their own: on the
                # training's group they would interleave with the steps' collectives.
                self._checkpoint_group = dist.new_group(backend="gloo")
            future = dcp.async_save(
                state, checkpoint_id=temporary, process_group=self._checkpoint_group
            )
            self._pending = (future, temporary, final)
        else:
            dcp.save(state, checkpoint_id=temporary)
            self._publish(temporary, final)
        self.checkpoint_blocked_s.append(time.perf_counter() - started)

    def finish_pending_save(self) -> None:
        """Waits for the asynchronous save in flight (if any), then gives it its name."""
        if self._pending is None:
            return
        future, temporary, final = self._pending
        self._pending = None
        future.result()
        self._publish(temporary, final)

    def _publish(self, temporary: Path, final: Path) -> None:
        """The complete folder takes its name; `last.ckpt`'s previous version is kept."""
        self.barrier()
        if self.is_global_zero:
            publish_folder(temporary, final)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        self.finish_pending_save()
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.finish_pending_save()
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(True)

    def teardown(self) -> None:
        self.finish_pending_save()
        super().teardown()


def publish_folder(temporary: Path, final: Path) -> None:
    """Renames within one folder (atomic on POSIX): a kill at any moment leaves a complete
    `last.ckpt`, or none and a complete `last.prev.ckpt` (`checkpoint_check.newest_complete`)."""
    _sync(temporary)
    if final.name == LAST and final.exists():
        previous = previous_of(final)
        if previous.is_dir():
            shutil.rmtree(previous)
        elif previous.exists():
            previous.unlink()
        os.replace(final, previous)
    elif final.is_dir():
        shutil.rmtree(final)
    elif final.exists():
        final.unlink()
    os.replace(temporary, final)
    _sync(final.parent)


def _sync(folder: Path) -> None:
    """The folder's files and entries reach the disk before it takes its name."""
    for path in [*folder.iterdir(), folder] if folder.is_dir() else [folder]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
