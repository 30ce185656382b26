"""Random numbers per rank, and in every checkpoint what an exact continuation needs.

Lightning's checkpoints hold the weights, optimizer, schedulers, loop counters and the
training loader's position (`data.ResumableDataLoader`). This callback adds the rest:

- Each rank draws its own random numbers: at setup every rank is seeded from (seed, rank),
  so dropout differs across ranks while a run stays reproducible for a seed and world size.
  The initial weights were drawn before, from `seed` alone, the same on every rank.
- Every rank's generator states (torch, CUDA, NumPy, Python: a few KiB each, whatever the
  model), gathered to rank 0 only, which writes the checkpoint.
- The communication hook's state (PowerSGD) once, not once per rank: its step counter, its
  generator and its low-rank factors Q are the same on every rank, and of each rank's
  compression error only the mean over ranks is kept (one all-reduce, the model's size on
  every rank). That mean is all the run's next steps depend on: each rank adds its error to
  its gradient before compressing, and what PowerSGD compresses and hands back is computed
  from the ranks' mean alone (P = mean(M_i) Q, Q = mean(M_i)^T P, with M_i = gradient_i +
  error_i), so a resume with every rank holding the mean error continues the same
  computation, at the same world size or another, up to the rounding of the sum's order.
  Gathering every rank's error instead would make rank 0's memory and the file grow with the
  world size (O(W x model)). PyTorch's own checkpoint of PowerSGD state keeps one rank's
  (`PowerSGDState.__getstate__`, saved from rank 0), which changes the sum.
  Checkpoints are therefore saved on all ranks together, as Lightning requires
  (ModelCheckpoint does; `trainer.save_checkpoint(path)` must be called on every rank).

On resume the states are put back when training starts, after Lightning's sanity check
(which re-seeds every generator at its end) and before the first batch.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

from ddp_template.worker.comm_hooks import (
    hook_state_dict,
    load_hook_state_dict,
    mean_error_feedback,
)
from ddp_template.worker.rng import derived_seed, numpy_state, plain_numpy_state

# Keys that tell the per-rank seed stream from the others drawn from `seed`.
_RANK_STREAM = 1


class ResumeState(L.Callback):
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._trainer: L.Trainer | None = None
        self._to_restore: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        rank_seed = derived_seed(self.seed, _RANK_STREAM, trainer.global_rank) % 2**32
        # Through Lightning, so that its own re-seeding (after the sanity check, in
        # ddp_spawn children) keeps this rank's seed.
        L.seed_everything(rank_seed, workers=True, verbose=False)

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None:
            return {}
        # CUDA's generators only where the run trains on CUDA: asking for them initialises
        # CUDA, which a CPU rank forked on a GPU machine could not (cuda_devices).
        on_cuda = trainer.strategy.root_device.type == "cuda"
        hook = mean_error_feedback(
            hook_state_dict(trainer.strategy.model), trainer.strategy.root_device
        )
        mine = {"rng": _plain_rng_states(_collect_rng_states(include_cuda=on_cuda))}
        gathered = _gather_to_rank_zero(mine, trainer)
        # Only rank 0's checkpoint is written; the others' states are in it.
        return {"ranks": gathered, "comm_hook": hook} if gathered is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict or None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saved, self._to_restore = self._to_restore, None
        if saved is None:
            return
        ranks = saved["ranks"]
        same_size = len(ranks) == trainer.world_size
        # Older checkpoints kept each rank's hook state: usable at the same world size.
        hook = saved.get("comm_hook") or (
            ranks[trainer.global_rank].get("comm_hook") if same_size else None
        )
        load_hook_state_dict(trainer.strategy.model, hook)
        if not same_size:
            if trainer.is_global_zero:
                # stdout: rank 0's reaches the console under this project's launcher.
                print(
                    f"Resuming at world size {trainer.world_size} from a checkpoint saved at"
                    f" world size {len(ranks)}: the data continues where it stood; each rank's"
                    " random numbers start afresh.",
                    flush=True,
                )
            return
        mine = ranks[trainer.global_rank]
        _set_rng_states(_rng_states(mine["rng"], trainer.strategy.root_device.type == "cuda"))


def _gather_to_rank_zero(mine: dict[str, Any], trainer: L.Trainer) -> list[Any] | None:
    """Every rank's state on rank 0 (None on the other ranks)."""
    if trainer.world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return [mine]
    everyone: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
    dist.gather_object(mine, everyone, dst=0)
    return everyone


def _plain_rng_states(states: dict[str, Any]) -> dict[str, Any]:
    return {**states, "numpy": plain_numpy_state(states["numpy"])}


def _rng_states(plain: dict[str, Any], on_cuda: bool) -> dict[str, Any]:
    states = {**plain, "numpy": numpy_state(plain["numpy"])}
    if not on_cuda:
        states.pop("torch.cuda", None)
    return states
