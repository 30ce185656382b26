"""The Optuna sweeper of `hparams_search=optuna_lr`, continued by `resume=true`
(conf/hparams_search/optuna_lr.yaml). The work is done in `ddp_template.resume.optuna_study`;
Hydra imports every module of this namespace at start-up, so this one stays light (and
loads hydra-optuna-sweeper only when it is used)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class ResumableOptunaSweeper(Sweeper):
    """hydra-optuna-sweeper's sweeper; with `resume=true` the study stored in the sweep
    folder goes on where it stopped instead of starting its trials over."""

    def __init__(self, **settings: Any) -> None:
        # alembic (Optuna's database tables) logs each of its plugins at INFO when imported.
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

        self.optuna = OptunaSweeper(**settings)
        self.config: DictConfig | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.optuna.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from ddp_template.resume.optuna_study import continue_study, study_storage

        assert self.config is not None
        # The sweep's config in its folder, as Hydra's basic sweeper saves it (Optuna's does
        # not): `resume=true` compares against it.
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.optuna.sweeper.storage = study_storage(self.optuna.sweeper.storage)
        if self.config.get("resume"):
            continue_study(self.optuna.sweeper, arguments)
        return self.optuna.sweep(arguments)
