"""An Optuna sweep continued with `resume=true`: its study is stored in the sweep folder
(`hydra.sweeper.storage`, conf/hparams_search/optuna_lr.yaml), and trial N runs in the
folder of job N.

Before the sweeper asks for new trials, the trials the stopped sweep had asked for and
not told (still `RUNNING` in the study) run again in their own folders: a job that had
finished reports its results, one that was interrupted continues from its last.ckpt, one
that never started starts. Their values are told to the study, and the sweeper then asks
only for the trials still missing of `n_trials`, numbered on from the study's (a
seeded sampler's generator is drawn afresh: its sequence would start over).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def study_storage(storage: Any) -> Any:
    """A database URL as the storage Optuna opens. optuna 2.10 (hydra-optuna-sweeper's)
    stamps a new database's schema version through a connection that SQLAlchemy 2 never
    commits: the stamp is lost, its own check of the version then fails, and the open
    transaction locks a SQLite file. The stamp is written in a transaction that commits."""
    if not isinstance(storage, str):
        return storage
    from unittest import mock

    import alembic.migration
    from optuna.storages import RDBStorage
    from optuna.storages._rdb.storage import _VersionManager

    def committed_stamp(manager: Any, revision: str) -> None:
        with manager.engine.begin() as connection:
            context = alembic.migration.MigrationContext.configure(connection)
            context.stamp(manager._create_alembic_script(), revision)

    class Storage(RDBStorage):
        def __repr__(self) -> str:  # the sweeper logs its storage
            return str(self.url)

    with mock.patch.object(_VersionManager, "_set_alembic_revision", committed_stamp):
        return Storage(storage)


def continue_study(sweeper: Any, arguments: list[str]) -> None:
    """`sweeper`: hydra-optuna-sweeper's OptunaSweeperImpl, set up, before its sweep."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    try:
        study = optuna.load_study(study_name=sweeper.study_name, storage=sweeper.storage)
    except KeyError:
        return  # no study stored yet: the sweep starts it
    _, fixed = create_params_from_overrides(sweeper._parse_sweeper_params_config() + arguments)
    stopped = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    for batch in _consecutive(stopped):
        numbers = ", ".join(str(trial.number) for trial in batch)
        log.info(f"Trials stopped with the sweep, continued in their folders: {numbers}")
        overrides = [
            [f"{name}={value}" for name, value in {**trial.params, **fixed}.items()]
            for trial in batch
        ]
        # Launched together, as the sweeper launched them (side by side with launcher=packed).
        returns = sweeper.launcher.launch(overrides, initial_job_idx=batch[0].number)
        for trial, result in zip(batch, returns, strict=True):
            _tell(study, trial.number, result)
    done = len(study.trials)
    if done and hasattr(sweeper.sampler, "reseed_rng"):
        # A seeded sampler starts its sequence over in a new process: its first proposals
        # would repeat the first trials'.
        sweeper.sampler.reseed_rng()
    sweeper.job_idx = done
    sweeper.n_trials = max(0, int(sweeper.n_trials) - done)
    log.info(f"Study {study.study_name}: {done} trials done, {sweeper.n_trials} to go")


def _consecutive(trials: list[Any]) -> list[list[Any]]:
    """Runs of consecutive trial numbers: a launch numbers its jobs on from its first."""
    batches: list[list[Any]] = []
    for trial in trials:
        if batches and batches[-1][-1].number + 1 == trial.number:
            batches[-1].append(trial)
        else:
            batches.append([trial])
    return batches


def _tell(study: Any, number: int, result: Any) -> None:
    import optuna

    try:
        value = float(result.return_value)
    except Exception as err:  # noqa: BLE001 - the job failed: so is its trial
        log.warning(f"Trial {number} failed: {err}")
        study.tell(number, state=optuna.trial.TrialState.FAIL)
        return
    study.tell(number, value)
