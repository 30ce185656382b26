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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_template.errors import ConfigError
from ddp_template.resume.checkpoint_io import LAST, previous_of

if TYPE_CHECKING:
    from omegaconf import DictConfig


def unreadable(path: Path) -> str | None:
    """Why the checkpoint file cannot be trusted, or None when it is complete: a torch.save
    archive with its directory (a truncated file has none) that torch.load(weights_only=True)
    reads (tensors mapped, not read)."""
    import torch

    if path.is_dir():
        return sharded_checkpoint_unreadable(path)
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


def sharded_checkpoint_unreadable(folder: Path) -> str | None:
    """Why a sharded (DCP) checkpoint folder cannot be trusted, or None: its metadata (DCP
    writes it last) and Lightning's, and every shard file it names, long enough."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from ddp_template.worker.sharding import DCP_METADATA, LIGHTNING_METADATA

    for name in (DCP_METADATA, LIGHTNING_METADATA):
        if not (folder / name).is_file():
            return f"a sharded checkpoint folder without its {name} (the save did not finish)"
    try:
        metadata = FileSystemReader(folder).read_metadata()
        torch.load(folder / LIGHTNING_METADATA, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read means: not usable
        return f"its metadata cannot be read: {type(err).__name__}: {_first_line(err)}"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            return f"the shard {name} is missing"
        if shard.stat().st_size < size:
            return f"the shard {name} is cut short ({shard.stat().st_size} of {size} bytes)"
    return None


def sharded_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The module's weights a sharded checkpoint holds, with their full shapes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "state_dict."
    return {
        key[len(prefix) :]: tuple(meta.size)
        for key, meta in FileSystemReader(folder).read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


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


def check_checkpoint(cfg: DictConfig, build_module: Callable[[DictConfig], Any]) -> None:
    """`ckpt_path`, before any worker starts: a complete training checkpoint whose weights
    fit the model this config builds (`build_module`: the config's LightningModule; not the
    exported `model.pt`, not another task's); a sharded folder of `strategy=fsdp` too
    (complete, of this model), whatever the strategy."""
    import torch

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
    if path.is_dir():
        _check_sharded_fits(cfg, path, build_module)
        return
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
    _check_fits(cfg, saved["state_dict"], saved.get("hyper_parameters") or {}, build_module)


def _check_sharded_fits(
    cfg: DictConfig, folder: Path, build_module: Callable[[DictConfig], Any]
) -> None:
    """A sharded checkpoint, by its metadata alone (no shard is read)."""
    import torch

    from ddp_template.worker.sharding import LIGHTNING_METADATA

    meta = torch.load(folder / LIGHTNING_METADATA, map_location="cpu", weights_only=True)
    shapes = {
        key: torch.empty(shape, device="meta") for key, shape in sharded_shapes(folder).items()
    }
    _check_fits(cfg, shapes, meta.get("hyper_parameters") or {}, build_module)


def _check_fits(
    cfg: DictConfig,
    saved_state: dict[str, Any],
    hyper_parameters: dict,
    build_module: Callable[[DictConfig], Any],
) -> None:
    """The saved weights are those of the model this config builds."""
    import torch

    with torch.device("meta"):
        module = build_module(cfg)
    difference = _difference(saved_state, module.state_dict())
    if difference:
        trained = _hyperparameter_differences(hyper_parameters, module)
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
