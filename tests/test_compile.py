"""`compile=true`: torch.compile (inductor) under DDP, recorded in results.json with the
compile time apart from the step times; a bad value stops before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runs import results, train


@pytest.mark.slow
def test_compiled_model_trains_under_ddp(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    proc = train(
        "task=tabular_classification",
        "compile=true",
        "strategy=ddp",
        "devices=2",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.num_sanity_val_steps=0",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["compile"] is True and out["world_size"] == 2
    # Inductor generated and built code for the forward and the backward.
    assert list(cache.rglob("*.py")), "inductor wrote no code: the model was not compiled"
    # The first steps compile; that time is reported apart and kept out of the step times.
    assert out["compile_time_s"] > 0
    assert out["warmup_time_s"] > 10 * out["step_time_median_s"]
    assert out["measured_steps"] >= 2 and "test/acc" in out
    assert "on: torch.compile on the LightningModule's forward" in " ".join(proc.stdout.split())


@pytest.mark.slow
def test_results_say_compile_is_off_by_default(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(
        "task=tabular_classification",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["compile"] is False and out["compile_time_s"] is None
    assert out["warmup_time_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["compile=maybe"], "compile='maybe'"),
        (["compile=true", "strategy=ddp_spawn", "devices=2"], "strategy=ddp_spawn"),
    ],
    ids=["maybe", "ddp_spawn"],
)
def test_bad_compile_exits_before_workers(overrides, expected, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "logs").exists() and not (run_dir / "results.json").exists()
