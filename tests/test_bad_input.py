"""Bad input: a one-paragraph error and a non-zero exit, before any worker process starts.
The first tests type it on the real command line; the mistakes below are checked in-process
(the same `resolve_and_check` the command runs), and tests/test_config.py checks more values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import FAST, compose_train, train

from ddp_template.build import build_task, build_trainer
from ddp_template.callbacks.startup_report import oversubscription_warning
from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError
from ddp_template.resume.folder import ResumeCheck, check_run_folder, check_sweep_folder
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
    "fsdp wrapping a class the model lacks": (
        ["strategy=fsdp", "devices=2", "strategy.wrap=[TransformerBlock]"],
        "strategy.wrap=['TransformerBlock']",
    ),
    "max_epochs=-5": (["trainer.max_epochs=-5"], "trainer.max_epochs=-5"),
    "negative lr": (
        ["devices=2", "task.module.optimizer.lr=-0.1"],
        "task.module.optimizer.lr=-0.1",
    ),
    # The fix names conf/'s value (0.1), not SGD's signature default (0.001).
    "lr=-1 names the config's default": (
        ["task.module.optimizer.lr=-1"],
        "Fix: e.g. task.module.optimizer.lr=0.1 (the config's default)",
    ),
    "unknown strategy": (["strategy=ddpp"], "strategy='ddpp' is not valid"),
    "negative patience": (
        ["callbacks=early_stopping", "callbacks.early_stopping.patience=-1"],
        "callbacks.early_stopping.patience=-1 is not valid: >= 0",
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
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: strategy='nope' is not valid: an option of the")
    assert "auto, ddp, ddp_spawn" in proc.stderr and "Fix:" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# An option no file of its config group holds: the group, its options and the closest.
UNKNOWN_OPTIONS = {
    "strategy": (["strategy=ddpp"], "strategy", "ddpp", "strategy=ddp (the closest)"),
    "task": (["task=regresion"], "task", "regresion", "task=regression (the closest)"),
    "loader": (["loader=tunned"], "loader", "tunned", "loader=tuned (the closest)"),
    "a debug list's entry": (["debug=[fast,watchdgo]"], "debug", "watchdgo", "debug=watchdog"),
    "a Hydra plugin's group": (
        ["hydra/launcher=pakced"],
        "hydra/launcher",
        "pakced",
        "hydra/launcher=packed (the closest)",
    ),
    "a group added with +": (["+experiment=benchmrk"], "experiment", "benchmrk", "benchmark"),
}


@pytest.mark.parametrize(
    "overrides,group,option,fix", UNKNOWN_OPTIONS.values(), ids=UNKNOWN_OPTIONS.keys()
)
def test_unknown_option_of_any_group_is_one_paragraph(overrides, group, option, fix) -> None:
    from ddp_template.config.plugins import check_override_keys
    from ddp_template.train import CONFIG_DIR

    with pytest.raises(ConfigError) as err:
        check_override_keys(overrides, CONFIG_DIR, "train")
    assert (err.value.key, err.value.value) == (group, option)
    assert f"an option of the config group {group}: " in str(err.value)
    assert fix in err.value.fix and "\n" not in str(err.value)


def _image_folder(root: Path, classes: int, per_class: int = 3) -> Path:
    """root/<class>/<i>.png: random 8 px PNGs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / f"class_{k}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{k}" / f"{i}.png")
    return root


def test_image_folder_of_one_class_is_refused_naming_the_folder(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "images", classes=1)
    with pytest.raises(ConfigError) as err:
        resolve_and_check(
            compose_train("data=imagefolder", f"data.root={root}", "data.batch_size=1")
        )
    assert err.value.key == "data.root"
    assert "at least two class sub-folders" in str(err.value) and "found one: class_0" in str(
        err.value
    )
    assert "num_classes" not in str(err.value)


def test_truncated_image_is_named_before_workers(tmp_path: Path) -> None:
    """A PNG cut in half (an interrupted copy) opens, and used to fail mid-epoch with a
    traceback that named no file."""
    root = _image_folder(tmp_path / "images", classes=2)
    cut = root / "class_1" / "2.png"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    with pytest.raises(ConfigError) as err:
        resolve_and_check(
            compose_train("data=imagefolder", f"data.root={root}", "data.batch_size=1")
        )
    assert err.value.key == "data.root" and f"{cut} is cut short" in str(err.value)
    # The same folder, whole again, passes.
    _image_folder(tmp_path / "whole", classes=2)
    resolve_and_check(
        compose_train("data=imagefolder", f"data.root={tmp_path / 'whole'}", "data.batch_size=1")
    )


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
    "negative patience": (
        ["callbacks=early_stopping", "callbacks.early_stopping.patience=-1"],
        "callbacks.early_stopping.patience",
        "validation rounds without improvement",
    ),
    "fsdp wrapping a class the model lacks": (
        ["strategy=fsdp", "devices=2", "strategy.wrap=[BasicBlock,TransformerBlock]"],
        "strategy.wrap",
        "it has no TransformerBlock (it has BasicBlock, BatchNorm2d, Conv2d,",
    ),
    "fsdp with a comm hook": (
        ["strategy=fsdp", "devices=2", "strategy.comm_hook=fp16"],
        "strategy.comm_hook",
        "communication hooks are DDP's",
    ),
    "fsdp with sync_batchnorm": (
        ["strategy=fsdp", "devices=2", "sync_batchnorm=true"],
        "sync_batchnorm",
        "false with strategy=fsdp",
    ),
    "fsdp with 16-mixed": (
        ["strategy=fsdp", "devices=2", "precision=16-mixed"],
        "precision",
        "Fix: precision=bf16-mixed",
    ),
    "fsdp offloading to the CPU on the CPU": (
        ["strategy=fsdp", "devices=2", "accelerator=cpu", "strategy.cpu_offload=true"],
        "strategy.cpu_offload",
        "on the CPU the parameters, gradients and optimizer state are in host memory",
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
        resolve_and_check(compose_train(*overrides))
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
    resolve_and_check(cfg)
    _, module = build_task(cfg)
    module.trainer = build_trainer(cfg, loggers=[])
    configured = module.configure_optimizers()["lr_scheduler"]
    assert configured["monitor"] == "val/acc" and configured["interval"] == "epoch"
    assert configured["scheduler"].mode == "max"


def test_endless_run_without_a_run_length_schedule_is_accepted() -> None:
    resolve_and_check(compose_train("trainer.max_epochs=-1", "task.module.scheduler=null"))


def test_epoch_schedule_gets_the_number_of_epochs() -> None:
    cfg = compose_train(
        "task.module.scheduler._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
        "~task.module.scheduler.max_lr",
        "task.module.scheduler_interval=epoch",
        "trainer.max_epochs=7",
    )
    resolve_and_check(cfg)
    _, module = build_task(cfg)
    module.trainer = build_trainer(cfg, loggers=[])
    assert module.configure_optimizers()["lr_scheduler"]["scheduler"].T_max == 7


def test_a_lone_last_sample_is_left_out_where_batchnorm_would_fail() -> None:
    """digits on 2 ranks with batches of 4: 629 samples a rank, 157 x 4 + 1. BatchNorm
    cannot train on the one: that batch is dropped; a model without BatchNorm keeps it."""
    cfg = compose_train("strategy=ddp", "devices=2", "data.batch_size=4")
    resolve_and_check(cfg)
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
    export_weights(module.model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(ConfigError) as err:
        resolve_and_check(compose_train(f"ckpt_path={tmp_path / 'model.pt'}"))
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
    resolve_and_check(compose_train(f"ckpt_path={checkpoints['image_classification']}"))
    with pytest.raises(ConfigError) as err:
        resolve_and_check(compose_train(f"ckpt_path={checkpoints['tabular_classification']}"))
    message = str(err.value)
    assert err.value.key == "ckpt_path" and len(message) < 1000, message
    assert "ImageClassificationModule" in message and "num_classes=2" in message
    assert "overrides.yaml" in err.value.fix


def _sharded_checkpoint(folder: Path, task: str) -> Path:
    """A DCP folder as strategy=fsdp writes it, saved in this one process."""
    import torch.distributed.checkpoint as dcp

    _, module = build_task(compose_train(f"task={task}"))
    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=folder, no_dist=True)
    meta = {"hyper_parameters": dict(module.hparams), "loops": {}}
    torch.save(meta, folder / "meta.pt")
    return folder


def test_incomplete_sharded_checkpoint_is_one_paragraph(tmp_path: Path) -> None:
    """A folder whose save did not finish, lost a shard or has one cut short is refused in
    the launching process, whatever the strategy resuming it."""
    folder = _sharded_checkpoint(tmp_path / "last.ckpt", "tabular_classification")
    overrides = ["task=tabular_classification", "strategy=fsdp", "devices=2"]
    resolve_and_check(compose_train(*overrides, f"ckpt_path={folder}"))
    shard = next(folder.glob("*.distcp"))
    data = shard.read_bytes()
    for damage, words in (
        (lambda: shard.write_bytes(data[: len(data) // 2]), f"the shard {shard.name} is cut short"),
        (shard.unlink, f"the shard {shard.name} is missing"),
        ((folder / ".metadata").unlink, "without its .metadata (the save did not finish)"),
    ):
        damage()
        for strategy in ("fsdp", "ddp"):
            with pytest.raises(ConfigError) as err:
                cfg = compose_train(*overrides, f"strategy={strategy}", f"ckpt_path={folder}")
                resolve_and_check(cfg)
            assert err.value.key == "ckpt_path" and words in str(err.value), str(err.value)
            assert "\n" not in str(err.value)


def test_checkpoint_of_another_model_is_refused_by_fsdp(tmp_path: Path) -> None:
    """A ddp checkpoint (one file) and a sharded folder, each of another task's model."""
    _, module = build_task(compose_train("task=image_classification"))
    of_ddp = tmp_path / "ddp.ckpt"
    state = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    torch.save({**state, "loops": {}}, of_ddp)
    sharded = _sharded_checkpoint(tmp_path / "sharded.ckpt", "image_classification")
    for checkpoint in (of_ddp, sharded):
        with pytest.raises(ConfigError) as err:
            overrides = ["task=tabular_classification", "strategy=fsdp", "devices=2"]
            resolve_and_check(compose_train(*overrides, f"ckpt_path={checkpoint}"))
        message = str(err.value)
        assert err.value.key == "ckpt_path" and "saved from another model" in message, message
        assert "TabularClassificationModule" in message and "\n" not in message


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
