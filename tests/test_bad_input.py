"""Bad input: a one-paragraph error and a non-zero exit, before any worker process starts.
The first tests type it on the real command line; the mistakes below are checked in-process
(the same `check_config` the command runs), and tests/test_config.py checks more values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST, compose_train, train

from ddp_template.callbacks.startup_report import oversubscription_warning
from ddp_template.config.checks import check_config
from ddp_template.config.resume_folder import ResumeCheck, check_run_folder, check_sweep_folder
from ddp_template.errors import ConfigError
from ddp_template.worker.build import build_task, build_trainer
from ddp_template.worker.results import export_weights

CASES = {
    "devices=abc": (["devices=abc"], "devices='abc'"),
    "precision=17": (["precision=17"], "precision=17"),
    "bucket_cap_mb=-5": (
        ["strategy=ddp", "devices=2", "strategy.bucket_cap_mb=-5"],
        "strategy.bucket_cap_mb=-5",
    ),
    "missing ckpt": (["ckpt_path=/no/such/file"], "ckpt_path='/no/such/file'"),
    "resume a folder without a job": (["resume=true"], "this one holds no job"),
    "missing folder": (
        ["data=imagefolder", "data.root=/no/such/folder"],
        "data.root='/no/such/folder'",
    ),
    "sync_batchnorm on cpu": (["sync_batchnorm=true", "accelerator=cpu"], "sync_batchnorm=True"),
    "seed=foo": (["seed=foo"], "seed='foo'"),
    "max_epochs=-5": (["trainer.max_epochs=-5"], "trainer.max_epochs=-5"),
    "negative lr": (
        ["devices=2", "task.module.optimizer.lr=-0.1"],
        "task.module.optimizer.lr=-0.1",
    ),
    "unreachable mlflow": (
        ["devices=2", "logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"],
        "logger.mlflow.tracking_uri='http://127.0.0.1:9'",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("overrides,expected", CASES.values(), ids=CASES.keys())
def test_bad_value_exits_before_workers(overrides, expected, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "logs").exists() and not (run_dir / "results.json").exists()


@pytest.mark.slow
def test_truncated_checkpoint(tmp_path: Path) -> None:
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.ones(10_000)}}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:4000])
    proc = train(
        f"ckpt_path={truncated}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2
    assert "not a complete torch.save archive" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_empty_image_folder(tmp_path: Path) -> None:
    (tmp_path / "images" / "cats").mkdir(parents=True)
    proc = train(
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert "found none" in proc.stderr


def test_unknown_strategy_lists_the_options(tmp_path: Path) -> None:
    proc = train("strategy=nope", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "strategy/nope" in proc.stderr
    for option in ("auto", "ddp", "ddp_spawn"):
        assert option in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_data_set_says_where_data_sets_come_from() -> None:
    """`data=shapes` before conf/data/shapes.yaml exists: the files there, and how to add one."""
    from ddp_template.config.plugins import check_override_keys
    from ddp_template.train import CONFIG_DIR

    with pytest.raises(ConfigError) as err:
        check_override_keys(["data=shapes"], CONFIG_DIR, "train")
    assert err.value.key == "data" and err.value.value == "shapes"
    message = str(err.value)
    assert "a file in conf/data/" in message and "digits, imagefolder" in message
    assert "add conf/data/shapes.yaml whose `source` names the class" in message


# Mistakes a new user makes, each refused in-process by the launching process's check (no
# worker started): the key named, what is allowed, and the fix.
MISTAKES = {
    "image folder without a root": (["data=imagefolder"], "data.root", "add data.root="),
    "batch larger than the training set": (
        ["data.batch_size=5000"],
        "data.batch_size",
        "one short step",
    ),
    "batch larger than the training set, dropped": (
        ["data.batch_size=5000", "data.drop_last=true"],
        "data.batch_size",
        "no step at all",
    ),
    "negative seed": (["seed=-1"], "seed", "from 0 to 4294967295"),
    "seed beyond NumPy's": ([f"seed={2**32}"], "seed", "e.g. seed=4294967295"),
    "endless run with a run-length schedule": (
        ["trainer.max_epochs=-1"],
        "trainer.max_epochs",
        "callbacks=early_stopping trainer.max_epochs=100",
    ),
    "no training batches": (
        ["trainer.limit_train_batches=0"],
        "trainer.limit_train_batches",
        "> 0",
    ),
    "a fraction leaving no batch": (
        ["trainer.limit_train_batches=0.001"],
        "trainer.limit_train_batches",
        "at least one of the 20 training batches",
    ),
    "plateau scheduler stepped per batch": (
        [
            "task.module.scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
            "~task.module.scheduler.max_lr",
        ],
        "task.module.scheduler_interval",
        "task.module.scheduler_interval=epoch",
    ),
    "validation interval beyond an epoch": (
        ["trainer.val_check_interval=1000"],
        "trainer.val_check_interval",
        "up to the 20 of an epoch",
    ),
    "validation split smaller than the ranks": (
        ["task=tabular_classification", "data=wine", "data.batch_size=1", "devices=32"],
        "devices",
        "the validation split has 18 samples, fewer than the 32 ranks",
    ),
    "misspelt model key": (
        ["+task.module.model.widht=32"],
        "task.module.model.widht",
        "build_resnet, and widht is none (its keys: arch, channels_last, dropout,",
    ),
    "held-out fractions leaving no training images": (
        ["data.val_fraction=0.5", "data.test_fraction=0.6"],
        "data.test_fraction",
        "with data.val_fraction=0.5, a sum below 1",
    ),
    "a data set file without its source class": (
        ["~data.source"],
        "data.source",
        "add `source: <the class>` to conf/data/digits.yaml",
    ),
    "misspelt optimizer key": (
        ["+task.module.optimizer.lrr=0.1"],
        "task.module.optimizer.lrr",
        "did you mean task.module.optimizer.lr?",
    ),
}


@pytest.mark.parametrize("overrides,key,words", MISTAKES.values(), ids=MISTAKES.keys())
def test_mistake_is_refused_before_workers(overrides, key, words) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(*overrides))
    assert err.value.key == key
    assert words in str(err.value), str(err.value)
    assert "Fix:" in str(err.value) and "\n" not in str(err.value)


def test_plateau_scheduler_steps_on_the_task_monitor() -> None:
    """ReduceLROnPlateau works as it is named: on task.monitor, in task.monitor_mode."""
    cfg = compose_train(
        "task.module.scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
        "~task.module.scheduler.max_lr",
        "task.module.scheduler_interval=epoch",
    )
    check_config(cfg)
    _, module = build_task(cfg)
    module.trainer = build_trainer(cfg, loggers=[])
    configured = module.configure_optimizers()["lr_scheduler"]
    assert configured["monitor"] == "val/acc" and configured["interval"] == "epoch"
    assert configured["scheduler"].mode == "max"


def test_endless_run_without_a_run_length_schedule_is_accepted() -> None:
    check_config(compose_train("trainer.max_epochs=-1", "task.module.scheduler=null"))


def test_epoch_schedule_gets_the_number_of_epochs() -> None:
    cfg = compose_train(
        "task.module.scheduler._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
        "~task.module.scheduler.max_lr",
        "task.module.scheduler_interval=epoch",
        "trainer.max_epochs=7",
    )
    check_config(cfg)
    _, module = build_task(cfg)
    module.trainer = build_trainer(cfg, loggers=[])
    assert module.configure_optimizers()["lr_scheduler"]["scheduler"].T_max == 7


def test_a_lone_last_sample_is_left_out_where_batchnorm_would_fail() -> None:
    """digits on 2 ranks with batches of 4: 629 samples a rank, 157 x 4 + 1. BatchNorm
    cannot train on the one: that batch is dropped; a model without BatchNorm keeps it."""
    cfg = compose_train("strategy=ddp", "devices=2", "data.batch_size=4")
    check_config(cfg)
    datamodule, _ = build_task(cfg)
    datamodule.setup("fit")
    models = {"batch": torch.nn.BatchNorm2d(1), "none": torch.nn.Linear(1, 1)}
    for norm, batches, smallest in (("batch", 157, 4), ("none", 158, 1)):
        datamodule.trainer = SimpleNamespace(
            world_size=2, global_rank=1, lightning_module=models[norm]
        )
        loader = datamodule.train_dataloader()
        assert len(loader) == batches
        assert min(len(labels) for _, labels in loader) == smallest


def test_exported_weights_are_not_a_checkpoint(tmp_path: Path) -> None:
    cfg = compose_train()
    _, module = build_task(cfg)
    export_weights(module.model, tmp_path / "model.pt")
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(f"ckpt_path={tmp_path / 'model.pt'}"))
    assert err.value.key == "ckpt_path"
    assert "a model's weights alone, such as the exported model.pt" in str(err.value)
    assert "checkpoints/last.ckpt" in err.value.fix


def test_checkpoint_of_another_task_is_one_paragraph(tmp_path: Path) -> None:
    """The weights' names and the hyper-parameters are compared in the launching process;
    a checkpoint of this task and model passes."""
    checkpoints = {}
    for task in ("tabular_classification", "image_classification"):
        _, module = build_task(compose_train(f"task={task}"))
        checkpoints[task] = tmp_path / f"{task}.ckpt"
        torch.save(
            {
                "state_dict": module.state_dict(),
                "hyper_parameters": dict(module.hparams),
                "loops": {},
            },
            checkpoints[task],
        )
    check_config(compose_train(f"ckpt_path={checkpoints['image_classification']}"))
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(f"ckpt_path={checkpoints['tabular_classification']}"))
    message = str(err.value)
    assert err.value.key == "ckpt_path" and len(message) < 1000, message
    assert "ImageClassificationModule" in message and "num_classes=2" in message
    assert "overrides.yaml" in err.value.fix


def test_more_ranks_than_cores_warns_about_the_ranks() -> None:
    warning = oversubscription_warning(local_ranks=8, workers=0, cores=2)
    assert warning is not None and "devices=2" in warning and "num_workers" not in warning


@pytest.mark.slow
def test_misspelt_key_on_the_command_line_gets_the_closest(tmp_path: Path) -> None:
    proc = train("trainer.max_epoch=1", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "did you mean trainer.max_epochs?" in proc.stderr
    assert "Fix: trainer.max_epochs=1" in proc.stderr and "+trainer" not in proc.stderr


@pytest.mark.slow
def test_batchnorm_trains_through_a_lone_last_sample_under_ddp(tmp_path: Path) -> None:
    """breast_cancer's 398 training rows on 2 ranks: 199 a rank, 99 batches of 2 and one
    of 1, which BatchNorm1d cannot train on. The whole epoch runs."""
    overrides = [o for o in FAST if not o.startswith("trainer.limit_train_batches")]
    proc = train(
        *overrides,
        "task=tabular_classification",
        "strategy=ddp",
        "devices=2",
        "data.batch_size=2",
        "test=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert "Expected more than 1 value per channel" not in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "results.json").is_file()


def test_misspelt_key_is_named_before_hydra_composes() -> None:
    """The check `train.py` makes before Hydra: a typo gets the closest key, and a valid
    command line, a sweep or an added key pass on to Hydra."""
    from ddp_template.config.plugins import check_override_keys
    from ddp_template.train import CONFIG_DIR

    with pytest.raises(ConfigError) as err:
        check_override_keys(["strategy=ddp", "trainer.max_epoch=1"], CONFIG_DIR, "train")
    assert err.value.key == "trainer.max_epoch" and err.value.fix == "trainer.max_epochs=1"
    for fine in (["trainer.max_epochs=1"], ["-m", "seed=1,2"], ["+trainer.max_epoch=1"]):
        check_override_keys(fine, CONFIG_DIR, "train")


def _composed_with_hydra(*overrides: str):
    """The config `python train.py <overrides>` runs, with its `hydra` node."""
    from hydra import compose, initialize_config_dir

    from ddp_template.train import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[*overrides, "accelerator=cpu"], return_hydra_config=True)


def _saved_run(folder: Path, *overrides: str) -> Path:
    """A run's folder as Hydra leaves it: its config in .hydra/config.yaml."""
    from omegaconf import OmegaConf

    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_train(*overrides), folder / ".hydra" / "config.yaml")
    return folder


def test_resume_of_a_folder_without_a_job_is_refused_before_hydra_writes(
    tmp_path: Path, capsys
) -> None:
    empty = tmp_path / "empty"
    config = _composed_with_hydra("resume=true", f"hydra.run.dir={empty}")
    with pytest.raises(SystemExit) as stop:
        ResumeCheck().on_run_start(config=config)
    assert stop.value.code == 2
    message = capsys.readouterr().err
    assert f"hydra.run.dir='{empty}'" in message and "holds no job" in message
    assert "Fix:" in message and message.count("\n") == 1
    assert not empty.exists()


def test_resume_of_a_run_of_another_config_names_the_keys_that_differ(tmp_path: Path) -> None:
    run = _saved_run(tmp_path / "run", "seed=1", "trainer.max_epochs=3")
    # devices may change on resume: the loader continues at another world size.
    here = compose_train("seed=2", "trainer.max_epochs=3", "devices=2", "resume=true")
    with pytest.raises(ConfigError) as err:
        check_run_folder(run, here)
    message = str(err.value)
    assert err.value.key == "hydra.run.dir" and "seed (1 there, 2 here)" in message
    assert "trainer.max_epochs" not in message and "devices" not in message
    assert "resume (" not in message and "overrides.yaml" in err.value.fix


def test_resume_of_a_run_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    run = _saved_run(tmp_path / "run", "seed=1")
    with pytest.raises(ConfigError) as err:
        check_run_folder(run, compose_train("seed=1", "resume=true"))
    assert "a run that saved a checkpoint" in str(err.value)
    assert "leave resume out" in err.value.fix


def test_resume_of_a_sweep_needs_the_sweep_of_the_same_command(tmp_path: Path) -> None:
    from omegaconf import OmegaConf, open_dict

    def sweep_config(*overrides: str):
        config = _composed_with_hydra()
        with open_dict(config):
            config.hydra.overrides.task = list(overrides)
        return config

    with pytest.raises(ConfigError, match="this one holds no sweep"):
        check_sweep_folder(tmp_path, sweep_config("seed=1,2,3", "resume=true"))
    OmegaConf.save(sweep_config("seed=1,2,3", "launcher=packed"), tmp_path / "multirun.yaml")
    # Another launcher, or the switch itself, keeps the jobs and their folders.
    check_sweep_folder(tmp_path, sweep_config("seed=1,2,3", "resume=true"))
    with pytest.raises(ConfigError) as err:
        check_sweep_folder(tmp_path, sweep_config("seed=1,3", "resume=true"))
    assert err.value.key == "hydra.sweep.dir"
    assert "hydra.overrides.task (['seed=1,2,3'] there, ['seed=1,3'] here)" in str(err.value)
