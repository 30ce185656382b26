"""Several nodes must share the file system that holds the job folder.

Only global rank 0 writes checkpoints, into its own job folder, and every rank reads them
back by that path: `best.ckpt` for the test after training, `last.ckpt` when a restart
resumes. On nodes with private disks (node-local scratch) the other nodes find no file:
the test fails on them after a whole training, and a restart would resume rank 0 and start
the others from scratch. So the job checks before training, once the process group is up
and before any checkpoint is read: rank 0 writes a file with a random token into its
checkpoint folder, tells every rank the path and the token, and each rank reads it back.
All ranks gather the answers and, if any node cannot read the file, all stop together with
the same message (no rank is left waiting in a collective).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, cast

import lightning as L
import torch

from ddp_template.errors import TrainingStopped

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ModelCheckpoint

PROBE_PREFIX = ".shared-disk-check-"
# A file just written on one node can take a moment to appear on another over NFS.
VISIBLE_WITHIN_S = 5.0


class SharedDiskCheck(L.Callback):
    """Stops a job of several nodes before training when the nodes do not see one file
    system for the checkpoint folder. One broadcast and one all_gather, at set-up only."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.num_nodes < 2 or trainer.checkpoint_callback is None:
            return
        probe, token = None, None
        if trainer.is_global_zero:
            # Lightning types it as the Checkpoint base class; the run's is a ModelCheckpoint.
            callback = cast("ModelCheckpoint", trainer.checkpoint_callback)
            folder = Path(callback.dirpath or trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            token = uuid.uuid4().hex
            probe = folder / f"{PROBE_PREFIX}{token}"
            probe.write_text(token)
        # Rank 0 set both before the broadcast.
        probe, token = cast("tuple[Path, str]", trainer.strategy.broadcast((probe, token), src=0))
        seen = _reads_back(Path(probe), token)
        answer = torch.tensor([int(seen), trainer.node_rank], device=trainer.strategy.root_device)
        answers = trainer.strategy.all_gather(answer).reshape(-1, 2).cpu()
        if trainer.is_global_zero:
            Path(probe).unlink(missing_ok=True)
        blind = [(rank, int(node)) for rank, (ok, node) in enumerate(answers.tolist()) if not ok]
        if blind:
            raise TrainingStopped(describe_private_disks(Path(probe).parent, blind))


def _reads_back(probe: Path, token: str) -> bool:
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while True:
        try:
            if probe.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def describe_private_disks(folder: Path, blind: list[tuple[int, int]]) -> str:
    ranks = ", ".join(str(rank) for rank, _ in blind)
    nodes = ", ".join(sorted({str(node) for _, node in blind}, key=int))
    return (
        f"The nodes of this job do not share a file system: rank 0 wrote a file into its "
        f"checkpoint folder {folder} and rank(s) {ranks} on node(s) {nodes} cannot read it. "
        "Only rank 0 writes checkpoints and every "
        "node reads them back (best.ckpt for the test after training, last.ckpt when a "
        "restart resumes), so a job of several nodes needs its folder on a shared file "
        "system. Fix: start every node in the same directory of a file system all nodes "
        "mount (or set hydra.run.dir to one), or train on one node"
    )
