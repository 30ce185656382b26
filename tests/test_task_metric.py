"""The task owns its metric and its direction: checkpointing, early stopping, the sweep's
objective and results.json follow `task.monitor` / `task.monitor_mode`; bad values are
refused before any worker starts. And any torch scheduler trains, resumes included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import compose_train, results, train
from hydra import compose, initialize_config_dir

from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError
from ddp_template.train import CONFIG_DIR

# Task -> (monitored metric, checkpoint mode, Optuna direction).
TASKS = {
    "image_classification": ("val/acc", "max", "maximize"),
    "tabular_classification": ("val/acc", "max", "maximize"),
    "regression": ("val/mse", "min", "minimize"),
}


@pytest.mark.parametrize("task", TASKS)
def test_checkpoint_early_stop_and_sweep_follow_the_task(task: str) -> None:
    monitor, mode, direction = TASKS[task]
    cfg = compose_train(f"task={task}", "callbacks=early_stopping")
    for callback in (cfg.callbacks.model_checkpoint, cfg.callbacks.early_stopping):
        assert (callback.monitor, callback.mode) == (monitor, mode)
    # The sweep's objective is the best validation value, never a test metric.
    assert cfg.optimized_metric == f"{monitor}_best"
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        search = compose(
            "train", [f"task={task}", "hparams_search=optuna_lr"], return_hydra_config=True
        )
    assert search.hydra.sweeper.direction == direction
    assert search.optimized_metric == f"{monitor}_best"


def test_early_stopping_adds_to_the_default_callbacks() -> None:
    default = compose_train().callbacks
    stopping = compose_train("callbacks=early_stopping").callbacks
    assert set(stopping) == {*default, "early_stopping"}


@pytest.mark.slow
def test_a_bad_monitor_mode_is_refused_before_workers_start(run_dir: Path, tmp_path: Path) -> None:
    proc = train("task.monitor_mode=up", f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "task.monitor_mode='up' is not valid" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "results.json").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["task=regression", "task.monitor=val/acc"],
            "task.monitor='val/acc' is not valid: a metric the task's module logs: "
            "train/mse, train/r2, val/mse, val/r2",
        ),
        (["task.module.scheduler_interval=batch"], "task.module.scheduler_interval='batch'"),
    ],
    ids=["never-logged", "interval"],
)
def test_what_the_config_check_refuses(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_and_check(compose_train(*overrides))
    assert message in str(err.value)


REGRESSION = [
    "task=regression",
    "logger=none",
    "trainer.enable_model_summary=false",
    "trainer.num_sanity_val_steps=0",
    "test=false",
]


def last_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.slow
def test_schedulers_that_need_no_run_length(run_dir: Path, tmp_path: Path) -> None:
    """StepLR stepped once per epoch halves the rate every epoch."""
    train(
        *REGRESSION,
        "trainer.max_epochs=3",
        "~task.module.scheduler",
        "+task.module.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,"
        "step_size:1,gamma:0.5}",
        "task.module.scheduler_interval=epoch",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    checkpoint = last_checkpoint(run_dir)
    (scheduler,) = checkpoint["lr_schedulers"]
    assert scheduler["last_epoch"] == 3
    lr = checkpoint["optimizer_states"][0]["param_groups"][0]["lr"]
    assert lr == pytest.approx(0.01 * 0.5**3)


@pytest.mark.slow
def test_cosine_annealing_gets_the_run_length(run_dir: Path, tmp_path: Path) -> None:
    train(
        *REGRESSION,
        "trainer.max_epochs=2",
        "~task.module.scheduler",
        "+task.module.scheduler={_target_:torch.optim.lr_scheduler.CosineAnnealingLR,"
        "_partial_:true}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    (scheduler,) = last_checkpoint(run_dir)["lr_schedulers"]
    assert scheduler["T_max"] == out["global_step"] == scheduler["last_epoch"]
    # At the end of its length the cosine reaches its minimum (eta_min, 0 by default).
    assert scheduler["_last_lr"][0] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.slow
def test_one_cycle_resumes_with_more_epochs(tmp_path: Path) -> None:
    """A OneCycle run resumed with a larger trainer.max_epochs stretches its schedule to
    the new length instead of stepping past the end of the old one."""
    first, second = tmp_path / "first", tmp_path / "second"
    train(*REGRESSION, "trainer.max_epochs=2", f"hydra.run.dir={first}", cwd=tmp_path)
    steps = results(first)["global_step"]
    train(
        *REGRESSION,
        "trainer.max_epochs=4",
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
        f"hydra.run.dir={second}",
        cwd=tmp_path,
    )
    out = results(second)
    assert out["global_step"] == 2 * steps
    (scheduler,) = last_checkpoint(second)["lr_schedulers"]
    assert scheduler["total_steps"] == 2 * steps and scheduler["last_epoch"] == 2 * steps


def test_the_report_shows_the_monitored_metric_of_each_job(tmp_path: Path) -> None:
    """Two jobs of a sweep (their results files as a run writes them): the report's column
    is the best validation value of the task's metric, named with its direction."""
    from ddp_template.tools.report import load_rows, markdown_table

    for job, best in (("0", 0.41), ("1", 0.37)):
        folder = tmp_path / job
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n")
        record = {
            "samples_per_sec": 10.0,
            "monitor": "val/mse",
            "monitor_mode": "min",
            "val/mse_best": best,
            "val/mse": best + 0.01,
        }
        (folder / "results.json").write_text(json.dumps(record))
    rows = load_rows(tmp_path)
    assert [row["monitor_best"] for row in rows] == [0.41, 0.37]
    table = markdown_table(rows)
    assert "| best val/mse (min) |" in table.splitlines()[0]
    assert "| 0.37 |" in table.splitlines()[3]
