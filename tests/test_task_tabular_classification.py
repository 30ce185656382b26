"""The tabular_classification task end to end, as users run it: one process, then two DDP processes
(gloo on the CPU). Short runs: the FAST switches of conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FAST, results, train

TASK = "task=tabular_classification"


def test_one_process(run_dir: Path, tmp_path: Path) -> None:
    train(TASK, *FAST, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert out["config"]["task"]["name"] == "tabular_classification"
    assert out["world_size"] == 1
    assert 0.0 <= out["test/acc"] <= 1.0
    assert (run_dir / "model.pt").is_file()
    assert (run_dir / "checkpoints" / "best.ckpt").is_file()


@pytest.mark.slow
def test_two_ddp_processes(run_dir: Path, tmp_path: Path) -> None:
    train(TASK, "strategy=ddp", "devices=2", *FAST, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert out["world_size"] == 2
    assert out["global_batch_size"] == 2 * out["config"]["data"]["batch_size"]
    assert 0.0 <= out["test/acc"] <= 1.0
