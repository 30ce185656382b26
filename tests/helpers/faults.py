"""Faults the diagnostics tests inject, each added from the command line, e.g.
`+callbacks.desync._target_=faults.DesyncRank`: a rank that drifts, a rank that stops in
a step, a module with a layer that never gets a gradient; and a probe of the debug
environment every rank saw."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

from ddp_template.debug import debug_print
from ddp_template.tasks.image_classification.module import ImageClassificationModule


class DesyncRank(L.Callback):
    """After the first training step, rank 1 nudges one weight: from then on the ranks
    train different models, which DDP never notices."""

    def __init__(self, parameter: str = "model.fc.weight") -> None:
        self.parameter = parameter

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 1:
            with torch.no_grad():
                dict(pl_module.named_parameters())[self.parameter].view(-1)[0] += 1e-3


class SleepInStep(L.Callback):
    """Rank 1 sleeps inside training step `step`, leaving the other ranks waiting in the
    gradient all-reduce. Writes the time it fell asleep to `<job>/asleep`."""

    def __init__(self, step: int = 1, seconds: float = 600.0) -> None:
        self.step = step
        self.seconds = seconds

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            (Path(trainer.default_root_dir) / "asleep").write_text(str(time.time()))
            time.sleep(self.seconds)


class UnusedBranchClassifier(ImageClassificationModule):
    """The image classifier with an extra head that forward never calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.unused_head = nn.Linear(4, 2)


class DebugProbe(L.Callback):
    """Calls debug_print on every rank and records the debug settings each rank runs with."""

    def on_train_start(self, trainer, pl_module) -> None:
        debug_print(f"hello from pid {os.getpid()}", f"world size {trainer.world_size}")
        record = {
            "TORCH_DISTRIBUTED_DEBUG": os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
            "debug_level": str(torch.distributed.get_debug_level()),
            "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE"),
            "anomaly": torch.is_anomaly_enabled(),
        }
        out = Path(trainer.default_root_dir) / "debug_probe" / f"rank_{trainer.global_rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record))


class StopAfterCheckpoint(L.Callback):
    """After optimizer step `step`, every rank saves `<job>/checkpoints/last.ckpt` together
    (as a preemption handler does) and the processes end at once, as if killed: a run
    interrupted mid-epoch at a known point."""

    EXIT_CODE = 75

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
            os._exit(self.EXIT_CODE)


class KillRankAfterStep(L.Callback):
    """Rank `rank` kills itself (SIGKILL) when batch `step` + 1 starts, i.e. after `step`
    optimizer steps (with a checkpoint every `step` steps, right after it is written): a
    hard crash at a known point, in the first attempt only (TORCHELASTIC_RESTART_COUNT)."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class HalfWrittenCheckpoint(L.Callback):
    """From save number `save` on, the checkpoint writer stops half-way through the file and
    waits (`<job>/writing` marks the moment): the test kills the process there, a real
    process killed in the middle of writing a checkpoint."""

    def __init__(self, save: int = 2) -> None:
        self.save = save

    def setup(self, trainer, pl_module, stage) -> None:
        from ddp_template.resume.checkpoint_io import SafeCheckpointIO

        marker = Path(trainer.default_root_dir) / "writing"
        first_slow = self.save

        class Stalling(SafeCheckpointIO):
            saves = 0

            def write(self, checkpoint, file) -> None:
                Stalling.saves += 1
                if Stalling.saves < first_slow:
                    super().write(checkpoint, file)
                    return
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                data = buffer.getvalue()
                file.write(data[: len(data) // 2])
                file.flush()
                marker.write_text(str(trainer.global_step))
                time.sleep(600)

        trainer.strategy.checkpoint_io = Stalling()


class HalfWrittenShards(L.Callback):
    """strategy=fsdp: from save number `save` on, each rank writes its shard, then cuts it
    to half its length and waits (`<job>/writing` marks the moment): the test kills the
    process there, in the middle of writing a sharded checkpoint."""

    def __init__(self, save: int = 2) -> None:
        self.save = save

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed.checkpoint as dcp

        marker = Path(trainer.default_root_dir) / "writing"
        first_slow, real_save, saves = self.save, dcp.save, [0]

        def stalling_save(state, checkpoint_id, **kwargs):
            saves[0] += 1
            result = real_save(state, checkpoint_id=checkpoint_id, **kwargs)
            if saves[0] < first_slow:
                return result
            shard = Path(checkpoint_id) / f"__{trainer.global_rank}_0.distcp"
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            marker.write_text(str(trainer.global_step))
            time.sleep(600)
            return result

        dcp.save = stalling_save
