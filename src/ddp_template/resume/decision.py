"""The decision an attempt makes before it trains: continue from the job's checkpoint (a
restart of the worker group, a SLURM requeue, `resume=true`), or start from `ckpt_path` (a
first attempt), or stop: an earlier run's state in a first attempt's folder, or a restart
with nothing usable to continue from (unless `restart_from_scratch`)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from ddp_template.errors import ConfigError, TrainingStopped


def resume_point(cfg: DictConfig) -> str | None:
    """A restart of the worker group, a SLURM requeue or `resume=true` continues from the
    job's newest complete checkpoint (`last.ckpt`, else the previous one, with a line saying
    so), and stops when there is none unless `restart_from_scratch`; a first attempt starts
    from `ckpt_path` (usually none), in a folder without an earlier run's state
    (`ResumeCheck` checked it before Hydra saved this config; checked here again where
    that callback did not run, a sweep's job)."""
    from ddp_template.resume.agent_records import note_agent_attempt
    from ddp_template.resume.checkpoint_check import newest_complete
    from ddp_template.resume.folder import (
        check_first_attempt_folder,
        continues_earlier_attempt,
    )

    job_dir = Path(cfg.paths.output_dir)
    if not continues_earlier_attempt(cfg, job_dir):
        try:
            check_first_attempt_folder(job_dir, cfg, saved=None)
        except ConfigError as err:
            raise TrainingStopped(str(err)) from None
        note_agent_attempt(job_dir)
        return cfg.ckpt_path
    note_agent_attempt(job_dir)
    resume_from, note = newest_complete(last_checkpoint(cfg))
    rank_zero = os.environ.get("RANK", "0") == "0"
    if resume_from is not None:
        if note and rank_zero:
            # stdout: rank 0's reaches the console under this project's launcher.
            print(note, flush=True)
        return str(resume_from)
    if cfg.get("resume"):
        # ResumeCheck found the job's results or `ckpt_path` to start from.
        return cfg.ckpt_path
    found = note or f"neither {last_checkpoint(cfg)} nor last.prev.ckpt beside it exists"
    if not cfg.get("restart_from_scratch", False):
        raise TrainingStopped(
            str(
                ConfigError(
                    "restart_from_scratch",
                    False,
                    "a restart or requeue continues from the job's checkpoint, and there is "
                    f"none to continue from: {found}",
                    "restart_from_scratch=true to train the job again from the start (its "
                    "training so far is lost), with ckpt_path=<a checkpoint> to start from "
                    "that one; or resume=true hydra.run.dir=<the run's folder> from a copy "
                    "that holds its checkpoint",
                )
            )
        )
    if rank_zero:
        start = cfg.ckpt_path or "the start"
        print(f"{found}: training again from {start} (restart_from_scratch=true)", flush=True)
    return cfg.ckpt_path


def last_checkpoint(cfg: DictConfig) -> Path:
    """Where the job's newest state is saved (callbacks.last_checkpoint, preemption)."""
    from ddp_template.resume.folder import last_checkpoint_of

    return last_checkpoint_of(Path(cfg.paths.output_dir))
