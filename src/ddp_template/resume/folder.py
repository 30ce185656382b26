"""`resume=true`: a run, or a whole sweep, continued in the folder it was started in.

    python train.py <overrides> hydra.run.dir=<old run folder> resume=true
    python train.py -m <the sweep's overrides> hydra.sweep.dir=<old sweep folder> resume=true

A job of the folder that finished (its `results.json`) is not run again: its results are
reported as they were. One that was interrupted continues from its `checkpoints/last.ckpt`
(`last.prev.ckpt` when that one is torn), and one that never saved a checkpoint starts
afresh. A sweep's jobs keep their folders: Hydra numbers them in the order the sweep
command lists them (`hydra.sweep.subdir`), the same order for the same command.

`ResumeCheck` (a Hydra callback, conf/hydra/default.yaml) checks the folder before Hydra
writes the new job's `.hydra/` over the old one, and before any worker starts: it must hold
a job (a sweep) of the same config, up to the keys a resume may change.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ddp_template.errors import ConfigError
from ddp_template.project import dotted
from ddp_template.resume.checkpoint_check import newest_complete
from ddp_template.resume.checkpoint_io import previous_of
from ddp_template.worker.results import RESULTS_FILE

SAVED_CONFIG = Path(".hydra") / "config.yaml"
SWEEP_CONFIG = "multirun.yaml"
# Keys a resume may change: the switch itself, where and on how many devices it runs (the
# loader continues at another world size, docs/resume.md), restarts, and Hydra's folders.
MAY_CHANGE = (
    "resume",
    "restart_from_scratch",
    "devices",
    "num_nodes",
    "max_restarts",
    "network",
    "paths",
    "hydra",
)
# What a sweep's command decides besides the config: which jobs it runs, in what order.
SWEEP_KEYS = ("hydra.overrides.task", "hydra.sweeper.params", "hydra.sweep.subdir")


def finished_results(job_dir: Path) -> dict[str, Any] | None:
    """The results of a job that finished (results.json is written last, whole), else None."""
    try:
        results = json.loads((job_dir / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return results if isinstance(results, dict) and "finished_at" in results else None


def last_checkpoint_of(job_dir: Path) -> Path:
    return job_dir / "checkpoints" / "last.ckpt"


def config_differences(saved: DictConfig | dict, composed: DictConfig | dict) -> list[str]:
    """`key (saved there, here now)` for each key, outside MAY_CHANGE, whose value differs
    (interpolations compared as written, not resolved)."""
    before = dotted(OmegaConf.to_container(OmegaConf.create(saved), resolve=False))
    after = dotted(OmegaConf.to_container(OmegaConf.create(composed), resolve=False))
    missing = object()
    differ = []
    for key in sorted(set(before) | set(after)):
        if key.split(".")[0] in MAY_CHANGE:
            continue
        old, new = before.get(key, missing), after.get(key, missing)
        if old != new:
            differ.append(f"{key} ({_shown(old, missing)} there, {_shown(new, missing)} here)")
    return differ


def sweep_differences(saved: DictConfig, composed: DictConfig) -> list[str]:
    """As `config_differences`, plus the sweep's own keys: the overrides and the sweeper's
    parameters, which decide the jobs and their folders."""
    differ = config_differences(saved, composed)
    before = OmegaConf.to_container(saved, resolve=False)
    after = OmegaConf.to_container(composed, resolve=False)
    for key in SWEEP_KEYS:
        old = _without_resume(_at(before, key))
        new = _without_resume(_at(after, key))
        if old != new:
            differ.append(f"{key} ({old!r} there, {new!r} here)")
    return differ


def _at(node: Any, key: str) -> Any:
    """The value at a dotted key of a plain container, interpolations as written."""
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _without_resume(value: Any) -> Any:
    """A sweep's overrides less those a resume may change: `resume`, the launcher, and
    single values of MAY_CHANGE keys (a swept one decides the jobs)."""
    if not isinstance(value, list):
        return value
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    kept = []
    for override in map(str, value):
        parsed = parser.parse_override(override)
        key = parsed.get_key_element().lstrip("+~")
        changeable = key == "launcher" or key.split(".")[0] in MAY_CHANGE
        if not (changeable and not parsed.is_sweep_override()):
            kept.append(override)
    return kept


def _shown(value: Any, missing: object) -> str:
    return "not set" if value is missing else repr(value)


def _listed(differences: list[str], shown: int = 5) -> str:
    more = len(differences) - shown
    return "; ".join(differences[:shown]) + (f"; and {more} more" if more > 0 else "")


def check_run_folder(folder: Path, cfg: DictConfig) -> None:
    """A single run's folder: a job of this config with a checkpoint (or its results)."""
    saved_config = folder / SAVED_CONFIG
    if not saved_config.is_file():
        raise ConfigError(
            "hydra.run.dir",
            str(folder),
            "with resume=true, the folder of an earlier run of this config; this one holds "
            f"no job ({SAVED_CONFIG} is missing)",
            "give the run's own folder (outputs/<date>/<time>_<pid>), or leave resume out "
            "to start a new run",
        )
    task_cfg = OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])
    differences = config_differences(_load_mapping(saved_config), task_cfg)
    if differences:
        raise ConfigError(
            "hydra.run.dir",
            str(folder),
            "with resume=true, a run of the same config; this folder's run had another: "
            + _listed(differences),
            f"resume with the overrides it was started with ({folder / '.hydra'}/"
            "overrides.yaml) plus resume=true, or leave resume out to start a new run",
        )
    if finished_results(folder) is None and _checkpoint_to_resume(folder, cfg) is None:
        raise ConfigError(
            "hydra.run.dir",
            str(folder),
            "with resume=true, a run that saved a checkpoint; this one has neither "
            f"{last_checkpoint_of(folder)} nor a complete previous one, nor results",
            "leave resume out to start it again, or give ckpt_path=<a checkpoint>",
        )


def _checkpoint_to_resume(folder: Path, cfg: DictConfig) -> Path | None:
    found, _ = newest_complete(last_checkpoint_of(folder))
    if found is None and cfg.get("ckpt_path"):
        return Path(cfg.ckpt_path)
    return found


def check_sweep_folder(folder: Path, cfg: DictConfig) -> None:
    """A sweep's folder: the sweep this command started before (its multirun.yaml)."""
    saved_config = folder / SWEEP_CONFIG
    if not saved_config.is_file():
        raise ConfigError(
            "hydra.sweep.dir",
            str(folder),
            f"with resume=true, the folder of an earlier sweep; this one holds no sweep "
            f"({SWEEP_CONFIG} is missing)",
            "give the sweep's own folder (multirun/<date>/<time>_<pid>), or leave resume "
            "out to start a new sweep",
        )
    differences = sweep_differences(_load_mapping(saved_config), cfg)
    if differences:
        raise ConfigError(
            "hydra.sweep.dir",
            str(folder),
            "with resume=true, a sweep of the same command; this folder's sweep had "
            "another: " + _listed(differences),
            f"resume with the command it was started with ({saved_config} holds its "
            "config and overrides) plus resume=true, or leave resume out to start a new sweep",
        )


def continues_earlier_attempt(cfg: DictConfig, job_dir: Path) -> bool:
    """An attempt the config or its launcher says continues the job in `job_dir`: a restart
    of the worker group (also on a node that rejoined without a failure of its own), a
    SLURM requeue, `resume=true`."""
    from ddp_template.resume.agent_records import rejoined_by_agent
    from ddp_template.resume.attempts import requeue_count, restart_count

    return (
        bool(cfg.get("resume"))
        or restart_count() > 0
        or requeue_count() > 0
        or rejoined_by_agent(job_dir)
    )


def check_first_attempt_folder(folder: Path, cfg: DictConfig, saved: Path | None) -> None:
    """A job's first attempt trains in a folder without an earlier run's state: a rerun
    under the same job id (`torchrun --rdzv-id`, `network.job_id`, `hydra.run.dir`) would
    otherwise continue the old run's checkpoint, or write over it, or over its results.
    `saved`: the folder's saved config, to name the keys that differ (None: not known).
    A start from `ckpt_path` in a folder that did not finish is the config's own choice."""
    last = last_checkpoint_of(folder)
    found = [path.name for path in (last, previous_of(last)) if path.exists()]
    finished = finished_results(folder) is not None
    if not finished and (not found or cfg.get("ckpt_path")):
        return
    held = (
        f"the results ({RESULTS_FILE}) of a finished run"
        if finished
        else (f"a checkpoint of an earlier run ({', '.join(found)} in {last.parent})")
    )
    if saved is not None and saved.is_file():
        task_cfg = OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])
        differences = config_differences(_load_mapping(saved), task_cfg)
        held += (
            ", whose config differs: " + _listed(differences)
            if differences
            else ", of the same config"
        )
    raise ConfigError(
        "hydra.run.dir",
        str(folder),
        "for a job's first attempt (not a restart, a requeue or resume=true), a folder "
        f"without an earlier run's state; this one holds {held}, which this attempt would "
        "continue or write over",
        "give the job a new id or folder (torchrun --rdzv-id=<new>, network.job_id=<new>, "
        "hydra.run.dir=<new>), or add resume=true to continue that run",
    )


class ResumeCheck(Callback):
    """Checks the folder a run trains in, before Hydra saves the new config there: the
    one a `resume=true` continues in, and that a first attempt holds no earlier run."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.run.dir))
        # Only the process that saves .hydra/ owns the folder (rank 0, see train.yaml).
        if config.get("resume") and config.hydra.output_subdir is not None:
            _refuse_on_error(check_run_folder, folder, config)
        if not continues_earlier_attempt(config, folder):
            # Every rank refuses (none may train into the folder); rank 0 says why.
            quiet = os.environ.get("RANK", "0") != "0"
            _refuse_on_error(
                check_first_attempt_folder, folder, config, folder / SAVED_CONFIG, quiet=quiet
            )

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Before the sweeper saves the new sweep's config over the old (both sweepers of the
        # project save it: Hydra's basic one, and ResumableOptunaSweeper).
        if config.get("resume"):
            _refuse_on_error(check_sweep_folder, Path(str(config.hydra.sweep.dir)), config)


def _refuse_on_error(
    check: Any, folder: Path, config: DictConfig, *args: Any, quiet: bool = False
) -> None:
    try:
        check(folder, config, *args)
    except ConfigError as err:
        if not quiet:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _load_mapping(path: Path) -> DictConfig:
    """A saved config (Hydra writes mappings only)."""
    loaded = OmegaConf.load(path)
    assert isinstance(loaded, DictConfig), path
    return loaded
