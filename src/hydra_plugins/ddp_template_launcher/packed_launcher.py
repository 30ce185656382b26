"""`launcher=packed` (conf/launcher/packed.yaml): the sweep's jobs side by side, each on its
own GPUs and CPU cores. The work is done in `ddp_template.launch.packing`; Hydra imports every
module of this namespace at start-up, so this one stays light."""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class PackedLauncher(Launcher):
    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from ddp_template.launch.packing import launch_packed

        assert self.config is not None and self.hydra_context is not None
        assert self.task_function is not None
        return launch_packed(
            self.jobs,
            self.config,
            self.hydra_context,
            self.task_function,
            job_overrides,
            initial_job_idx,
        )
