"""Real multi-process DDP on the CPU (gloo): what data parallelism must get right beyond what
tests/test_every_task.py checks for every task (identical weights, disjoint shards, every
evaluation sample once, 2 x B == 1 x 2B, resume == uninterrupted, only rank 0 writing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runs import FAST, probes, results, train

PROBE = "+callbacks.probe._target_=probe.Probe"


@pytest.mark.slow
def test_uneven_data_on_four_ranks_finishes(run_dir: Path, tmp_path: Path) -> None:
    """1,001 samples on 4 ranks in train, validation and test: no hang, nothing counted twice."""
    train(
        "strategy=ddp",
        "devices=4",
        PROBE,
        "data=synthetic",
        "data.num_samples=1001",
        "data.eval_samples=1001",
        "data.image_size=8",
        "data.batch_size=100",
        "task.module.model.arch=resnet18",
        "trainer.max_epochs=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=400,
    )
    ranks = probes(run_dir)
    assert len(ranks) == 4
    assert sorted(sum((r["test"] for r in ranks), [])) == list(range(1001))
    assert sum(r["test_samples_seen"] for r in ranks) == 1001
    assert results(run_dir)["world_size"] == 4


@pytest.mark.slow
def test_results_record_the_live_ddp_settings(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(
        *FAST,
        "strategy=ddp",
        "devices=2",
        "strategy.bucket_cap_mb=7",
        "strategy.static_graph=true",
        "strategy.forward_sync_buffers=false",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    ddp = out["ddp"]
    assert ddp["bucket_cap_mb"] == 7.0
    assert ddp["static_graph"] is True and ddp["find_unused_parameters"] is False
    # The model has BatchNorm; switched off, DDP broadcasts none of its buffers.
    assert ddp["forward_sync_buffers"] is False
    assert out["gradients"]["broadcast_buffer_bytes"] == {}
    # When each gradient was ready in the backward, in the order DDP buckets them (the
    # last layer's first): the scaling model schedules each bucket from these.
    ready = out["gradients"]["ready_fractions"]
    assert len(ready) == len(out["gradients"]["shapes"])
    assert all(0 <= share <= 1 for share in ready)
    assert ready[0] < ready[-1]


@pytest.mark.slow
def test_ddp_spawn_runs(run_dir: Path, tmp_path: Path) -> None:
    train(*FAST, "strategy=ddp_spawn", "devices=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert out["world_size"] == 2 and out["strategy"] == "ddp_spawn" and "test/acc" in out
