"""The image_classification task keeps its promise: it learns. (Its full default run, 95%
test accuracy on the digits, is in test_runs.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runs import results, train

TASK = "task=image_classification"


@pytest.mark.slow
def test_it_learns_a_few_batches_by_heart(run_dir: Path, tmp_path: Path) -> None:
    """Two batches of 16 images, seen again and again: a model that learns fits them all
    (chance is one in ten classes)."""
    train(
        TASK,
        "debug=overfit",
        "data.batch_size=16",
        "logger=none",
        "trainer.enable_model_summary=false",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["train/acc"] == 1.0, (
        f"training accuracy {out['train/acc']} on the 2 batches seen again and again, "
        "expected 1.0 (every image fitted): the network does not learn them by heart"
    )
    assert out["train/loss"] < 0.05, (
        f"training loss {out['train/loss']} on the 2 memorised batches, expected < 0.05"
    )
