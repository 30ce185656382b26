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

# The checkpoint a restart or requeue resumes from: its previous version is kept.
LAST = "last.ckpt"


def previous_of(path: Path) -> Path:
    """`last.ckpt` -> `last.prev.ckpt`: the previous complete version."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


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


def _sync_folder(folder: Path) -> None:
    """The renames reach the disk too (a folder's entries are synced with the folder)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
