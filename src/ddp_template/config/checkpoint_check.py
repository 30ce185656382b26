"""Checkpoints checked before they are trusted.

A restart or requeue resumes from the job's `last.ckpt` (train.py); `newest_complete`
checks it first and falls back to `last.prev.ckpt`, the previous complete checkpoint kept
by `checkpoint_io.SafeCheckpointIO`, when `last.ckpt` is torn or missing.

`check_checkpoint` checks `ckpt_path` in the launching process, before any worker starts:
complete, a training checkpoint (not the exported `model.pt`), and of the model the config
builds (not another task's).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_template.errors import ConfigError
from ddp_template.worker.checkpoint_io import LAST, previous_of

if TYPE_CHECKING:
    from omegaconf import DictConfig


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


def check_checkpoint(cfg: DictConfig) -> None:
    """`ckpt_path`, before any worker starts: a complete training checkpoint whose weights
    fit the model this config builds (not the exported `model.pt`, not another task's)."""
    import torch

    from ddp_template.worker.build import build_task

    if cfg.get("ckpt_path") is None:
        return
    path = Path(cfg.ckpt_path)
    reason = unreadable(path)
    if reason is not None:
        raise ConfigError(
            "ckpt_path",
            cfg.ckpt_path,
            f"a complete Lightning checkpoint; this one cannot be used: {reason}",
            _fix_for_missing(path),
        )
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(saved, dict) or "state_dict" not in saved or "loops" not in saved:
        raise ConfigError(
            "ckpt_path",
            cfg.ckpt_path,
            "a Lightning training checkpoint (weights, optimizer, loop counters, the data's "
            f"position); this file holds {_what_it_holds(saved)}",
            "resume from the job's checkpoints/last.ckpt (or best.ckpt); model.pt is for "
            "loading the trained model elsewhere (torch.load, then load_state_dict)",
        )
    with torch.device("meta"):
        _, module = build_task(cfg)
    difference = _difference(saved["state_dict"], module.state_dict())
    if difference:
        trained = _hyperparameter_differences(saved.get("hyper_parameters") or {}, module)
        raise ConfigError(
            "ckpt_path",
            cfg.ckpt_path,
            f"a checkpoint of the model this config builds ({type(module).__name__}, "
            f"task={cfg.task.name}, data={cfg.data.name}); this one was saved from another "
            f"model: {difference}" + (f"; it was trained with {trained}" if trained else ""),
            "resume with the task=, data= and task.module.model settings the checkpoint was "
            "saved with (its run's .hydra/overrides.yaml), or leave ckpt_path out to start afresh",
        )


def _hyperparameter_differences(saved: dict[str, Any], module: Any) -> str:
    """The module's arguments the checkpoint was saved with that differ from this one's."""
    built = dict(getattr(module, "hparams", {}))
    missing = object()
    differ = [
        f"{key}={saved[key]!r} (here {built.get(key, 'not set')!r})"
        for key in saved
        if built.get(key, missing) != saved[key]
    ]
    return ", ".join(differ[:4])


def _what_it_holds(saved: object) -> str:
    import torch

    if isinstance(saved, dict) and all(isinstance(v, torch.Tensor) for v in saved.values()):
        return "a model's weights alone, such as the exported model.pt"
    if isinstance(saved, dict) and "state_dict" in saved:
        return "weights without the training state (a checkpoint saved with save_weights_only)"
    return f"a {type(saved).__name__}, not a checkpoint"


def _difference(saved: dict[str, Any], expected: dict[str, Any], shown: int = 2) -> str:
    """What tells the saved weights from the expected ones, in one sentence ('' if nothing)."""
    extra = [key for key in saved if key not in expected]
    missing = [key for key in expected if key not in saved]
    reshaped = [
        f"{key} {tuple(saved[key].shape)} here {tuple(expected[key].shape)}"
        for key in saved
        if key in expected and tuple(saved[key].shape) != tuple(expected[key].shape)
    ]
    parts = [
        f"{len(keys)} {what} (e.g. {', '.join(keys[:shown])})"
        for keys, what in (
            (extra, "weights this model does not have"),
            (missing, "of this model's weights missing"),
            (reshaped, "of another shape"),
        )
        if keys
    ]
    return "; ".join(parts)


def _fix_for_missing(path: Path) -> str:
    previous = previous_of(path)
    if path.name == LAST and unreadable(previous) is None:
        return f"use {previous}, the previous complete checkpoint of that job"
    return "check the path, or use another checkpoint of the job (checkpoints/last.ckpt)"
