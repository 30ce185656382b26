"""Bad input, typed on the real command line: a one-paragraph error and a non-zero exit,
before any worker process starts. (tests/test_config.py checks every refused value in-process;
these run the real command for a sample of them.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train

CASES = {
    "devices=abc": (["devices=abc"], "devices='abc'"),
    "precision=17": (["precision=17"], "precision=17"),
    "bucket_cap_mb=-5": (
        ["strategy=ddp", "devices=2", "strategy.bucket_cap_mb=-5"],
        "strategy.bucket_cap_mb=-5",
    ),
    "missing ckpt": (["ckpt_path=/no/such/file"], "ckpt_path='/no/such/file'"),
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


@pytest.mark.parametrize("overrides,expected", CASES.values(), ids=CASES.keys())
def test_bad_value_exits_before_workers(overrides, expected, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "logs").exists() and not (run_dir / "results.json").exists()


def test_truncated_checkpoint(tmp_path: Path) -> None:
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.ones(10_000)}}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:4000])
    proc = train(
        f"ckpt_path={truncated}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2
    assert "cannot be read" in proc.stderr and "Traceback" not in proc.stderr


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
