"""Callbacks the packing and start-up tests add with `+callbacks.<name>._target_=lane_probe.<Class>`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from hydra.experimental.callback import Callback


class LaneProbe(L.Callback):
    """Records, on every rank, the share of the machine it ran on, when it trained, the
    learning rate its optimizer was built with, how its process came to be, and what
    Lightning believed its rank was before the Trainer existed (this callback is built
    first). At the process's exit it leaves a file, as an exit function."""

    def __init__(self) -> None:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        self.rank_before_trainer = rank_zero_only.rank

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        factory = getattr(pl_module, "optimizer_factory", None)
        self.record = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "lr": factory.keywords.get("lr") if factory is not None else None,
            "rank_zero_only_rank_before_trainer": self.rank_before_trainer,
            "rank_zero_only_rank": rank_zero_only.rank,
            "root_log_handlers": len(logging.getLogger().handlers),
            "cmdline": Path("/proc/self/cmdline").read_text().replace("\0", " "),
            "job_start": _job_start_time(),
            "fit_start": time.time(),
        }

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["fit_end"] = time.time()
        folder = Path(trainer.default_root_dir) / "lane_probe"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank_{trainer.global_rank}.json").write_text(json.dumps(self.record))
        atexit.register((folder / f"exited_rank_{trainer.global_rank}").touch)


def _job_start_time() -> float:
    """When the process that runs the job came to be: this one, or for a rank started by
    the job's elastic agent, the agent's."""
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    with open(f"/proc/{pid}/stat") as stat:
        started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as uptime:
        now_since_boot = float(uptime.read().split()[0])
    return time.time() - (now_since_boot - started_ticks / os.sysconf("SC_CLK_TCK"))


class KillOwnProcess(L.Callback):
    """Kills the process it trains in at training step `at_step` (a crash, an out-of-memory
    kill); never when `at_step` is negative."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.at_step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class ThreadInSweep(Callback):
    """Hydra callback: a thread in the sweep's process from the start of the sweep (a
    tracker's uploader would be one), so that its jobs cannot be forked."""

    def on_multirun_start(self, config, **kwargs) -> None:
        import threading

        threading.Thread(target=threading.Event().wait, daemon=True).start()
