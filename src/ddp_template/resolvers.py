"""OmegaConf resolvers used by `conf/`."""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf


def job_stamp() -> str:
    """Name of a run's folder: the same in every process of one job, unique across jobs.

    Under torchrun every rank composes the config itself, so a time stamp would differ from
    rank to rank (and from one restart to the next): the elastic run id is shared by all of
    them instead. Otherwise: date/time plus the process id, unique within the same second.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"torchrun/{run_id}"
    return time.strftime("%Y-%m-%d/%H-%M-%S") + f"_{os.getpid()}"


def register() -> None:
    OmegaConf.register_new_resolver("job_stamp", job_stamp, use_cache=True, replace=True)
