"""Random numbers per rank, and in every checkpoint what an exact continuation needs.

Lightning's checkpoints hold the weights, optimizer, schedulers, loop counters and the
training loader's position (`data.ResumableDataLoader`). This callback adds the rest:

- Each rank draws its own random numbers: at setup every rank is seeded from (seed, rank),
  so dropout differs across ranks while a run stays reproducible for a seed and world size.
  The initial weights were drawn before, from `seed` alone, the same on every rank.
- Every rank's generator states (torch, CUDA, NumPy, Python) and communication hook state
  (PowerSGD), gathered to rank 0, which writes the checkpoint. Checkpoints are therefore
  saved on all ranks together, as Lightning requires (ModelCheckpoint does;
  `trainer.save_checkpoint(path)` must be called on every rank).

On resume the states are put back when training starts, after Lightning's sanity check
(which re-seeds every generator at its end) and before the first batch.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities import rank_zero_warn

from ddp_template.comm_hooks import hook_state_dict, load_hook_state_dict
from ddp_template.rng import derived_seed, numpy_state, plain_numpy_state

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
        mine = {
            "rng": _plain_rng_states(_collect_rng_states(include_cuda=on_cuda)),
            "comm_hook": hook_state_dict(trainer.strategy.model),
        }
        return {"ranks": _gather(mine, trainer.world_size)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict or None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning hands the saved loader position to the loader when it sets the loader
        # up; a scheduler sized by `trainer.estimated_stepping_batches` makes it set the
        # loader up before the checkpoint is read, and the position would be dropped. The
        # loader starts iterating at its first batch, still to come here.
        trainer.fit_loop._load_combined_loader_states()
        saved, self._to_restore = self._to_restore, None
        if saved is None:
            return
        ranks = saved["ranks"]
        if len(ranks) != trainer.world_size:
            rank_zero_warn(
                f"The checkpoint was saved by {len(ranks)} ranks and this run has"
                f" {trainer.world_size}: random numbers and gradient compression start afresh,"
                " so training does not continue exactly as the saved run would have."
            )
            return
        mine = ranks[trainer.global_rank]
        _set_rng_states(_rng_states(mine["rng"], trainer.strategy.root_device.type == "cuda"))
        load_hook_state_dict(trainer.strategy.model, mine["comm_hook"])


def _gather(mine: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    if world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def _plain_rng_states(states: dict[str, Any]) -> dict[str, Any]:
    return {**states, "numpy": plain_numpy_state(states["numpy"])}


def _rng_states(plain: dict[str, Any], on_cuda: bool) -> dict[str, Any]:
    states = {**plain, "numpy": numpy_state(plain["numpy"])}
    if not on_cuda:
        states.pop("torch.cuda", None)
    return states
