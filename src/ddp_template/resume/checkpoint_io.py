"""Checkpoints that cannot be torn: complete on disk before they take their name, and the
previous `last.ckpt` kept until the new one is.

Lightning's `TorchCheckpointIO` writes through fsspec's transaction, whose temporary file
is made in the system's temporary folder (`tempfile.mkstemp()`, `$TMPDIR`) and then moved
with `shutil.move`. When that folder and the checkpoint folder are different file systems
(node-local scratch and NFS or Lustre), the move is a copy under the final name: a kill
during it (out of memory, a lost node, a scheduler's SIGTERM) leaves a torn file there, and
nothing is synced to disk before the name is given.

`SafeCheckpointIO` writes the checkpoint into a hidden temporary file in the checkpoint's
own folder, syncs it to disk, renames the current `last.ckpt` to `last.prev.ckpt` and then
renames the new file to `last.ckpt` (renames within one folder are atomic on POSIX file
systems), and syncs the folder. A kill at any moment leaves a complete `last.ckpt`, or, between
the two renames, no `last.ckpt` and a complete `last.prev.ckpt`: resuming takes the newest
complete one (`checkpoint_check.newest_complete`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from ddp_template.project import LAST, previous_of


# The checkpoint a restart or requeue resumes from: its previous version is kept.
def _temporary_of(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


class SafeCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if "://" in str(path):
            # Object stores (s3://, gs://) write whole objects; Lightning's way fits them.
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = _temporary_of(final)
        with temporary.open("wb") as file:
            self.write(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        if final.name == LAST and final.exists():
            os.replace(final, previous_of(final))
        os.replace(temporary, final)
        _sync_folder(final.parent)
        # What an earlier attempt killed while writing left behind.
        for torn in final.parent.glob(f".{final.name}.*.tmp"):
            torn.unlink(missing_ok=True)

    def write(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        torch.save(checkpoint, file)

    def load_checkpoint(
        self, path: _PATH, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if Path(path).is_dir():
            # A sharded checkpoint of strategy=fsdp, resumed by ddp or one process.
            return plain_from_sharded(Path(path))
        return super().load_checkpoint(path, weights_only=weights_only)


def plain_from_sharded(folder: Path) -> dict[str, Any]:
    """A sharded (DCP) checkpoint folder as the one-file checkpoint `ddp` writes: the full
    weights, and each optimizer's state keyed by parameter index, as torch's optimizers
    keep it (DCP keys it by parameter name, in the optimizer's own order)."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(folder)
    optimizers = sorted(key for key in checkpoint if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [_keyed_by_index(checkpoint.pop(key)) for key in optimizers]
    return checkpoint


def _keyed_by_index(state: dict[str, Any]) -> dict[str, Any]:
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: position for position, name in enumerate(names)}
    groups = [
        {**group, "params": [index[name] for name in group["params"]]}
        for group in state["param_groups"]
    ]
    return {
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": groups,
    }


def _sync_folder(folder: Path) -> None:
    """The renames reach the disk too (a folder's entries are synced with the folder)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
