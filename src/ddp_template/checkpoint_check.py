"""Checkpoints checked before they are trusted.

A restart or requeue resumes from the job's `last.ckpt` (train.py); `newest_complete`
checks it first and falls back to `last.prev.ckpt`, the previous complete checkpoint kept
by `checkpoint_io.SafeCheckpointIO`, when `last.ckpt` is torn or missing.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from ddp_template.checkpoint_io import previous_of


def unreadable(path: Path) -> str | None:
    """Why the checkpoint file cannot be trusted, or None when it is complete: a torch.save
    archive with its directory (a truncated file has none) that torch.load(weights_only=True)
    reads (tensors mapped, not read)."""
    import torch

    if not path.is_file():
        return "the file does not exist"
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"not a complete torch.save archive ({err})"
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any failure to load means: not usable
        return f"torch.load(weights_only=True) fails: {type(err).__name__}: {_first_line(err)}"
    return None


def newest_complete(last: Path) -> tuple[Path | None, str | None]:
    """The checkpoint to resume from, `last` or else its previous version, and one line
    saying so when `last` cannot be used (None: it can, or there is no checkpoint at all)."""
    reason = unreadable(last)
    if reason is None:
        return last, None
    previous = previous_of(last)
    if not last.exists() and not previous.exists():
        return None, None
    if unreadable(previous) is None:
        return (
            previous,
            f"{last} cannot be used ({reason}): resuming from {previous.name}, "
            "the previous complete checkpoint",
        )
    return (
        None,
        f"{last} cannot be used ({reason}) and there is no previous complete checkpoint beside it",
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
