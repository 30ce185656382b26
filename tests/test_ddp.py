"""Real multi-process DDP on the CPU (gloo): what data parallelism must get right."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import FAST, probes, results, train

PROBE = "+callbacks.probe._target_=probe.Probe"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """One 2-process run shared by the tests that only read what it left behind."""
    tmp = tmp_path_factory.mktemp("ddp")
    run_dir = tmp / "run"
    train(
        "strategy=ddp",
        "devices=2",
        PROBE,
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=3",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        f"hydra.run.dir={run_dir}",
        cwd=tmp,
    )
    return run_dir


@pytest.mark.slow
def test_every_rank_ends_with_identical_weights(ddp_run: Path) -> None:
    ranks = probes(ddp_run)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
    assert ranks[0]["weights_abs_sum"] == ranks[1]["weights_abs_sum"]


@pytest.mark.slow
def test_training_shards_are_disjoint_and_reshuffled(ddp_run: Path) -> None:
    ranks = probes(ddp_run)
    train_size = 1797 - round(1797 * 0.1) - round(1797 * 0.2)
    for epoch in ("0", "1"):
        shards = [r["train"][epoch] for r in ranks]
        assert len(shards[0]) == len(shards[1])
        together = Counter(shards[0] + shards[1])
        assert set(together) == set(range(train_size))
        # Only the padding (to make shards even) repeats a sample.
        assert sum(c - 1 for c in together.values()) == len(shards[0]) * 2 - train_size
    for r in ranks:
        assert r["train"]["0"] != r["train"]["1"]


@pytest.mark.slow
def test_evaluation_sees_every_sample_once(ddp_run: Path) -> None:
    ranks = probes(ddp_run)
    test_size = round(1797 * 0.2)
    assert test_size % 2 == 1  # an odd split: padding would have added a duplicate
    seen = ranks[0]["test"] + ranks[1]["test"]
    assert sorted(seen) == list(range(test_size))
    assert sum(r["test_samples_seen"] for r in ranks) == test_size


@pytest.mark.slow
def test_only_rank_zero_writes_and_logs_stay_in_the_job_folder(ddp_run: Path) -> None:
    out = results(ddp_run)
    assert out["world_size"] == 2 and out["global_batch_size"] == 128
    assert sorted(p.name for p in ddp_run.parent.iterdir()) == ["run"]
    for rank in (0, 1):
        assert (ddp_run / "logs" / "attempt_0" / str(rank) / "stderr.log").is_file()
    # last.prev.ckpt: the epoch-1 last.ckpt, kept until the epoch-2 one was complete.
    assert sorted(p.name for p in (ddp_run / "checkpoints").iterdir()) == [
        "best.ckpt",
        "last.ckpt",
        "last.prev.ckpt",
    ]


@pytest.mark.slow
def test_ddp_test_accuracy_equals_single_process_accuracy(ddp_run: Path) -> None:
    """The reported accuracy is that of the checkpoint on the full test set, no padding."""
    import lightning as L
    from omegaconf import OmegaConf

    from ddp_template.build import build_task

    out = results(ddp_run)
    cfg = OmegaConf.create(out["config"])
    datamodule, _ = build_task(cfg)
    from ddp_template.tasks.image_classification.module import ImageClassificationModule

    module = ImageClassificationModule.load_from_checkpoint(
        out["checkpoints"]["best"], weights_only=True
    )
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (single,) = trainer.test(module, datamodule=datamodule, verbose=False)
    assert single["test/acc"] == pytest.approx(out["test/acc"], abs=1e-7)


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]


@pytest.mark.slow
def test_two_ranks_of_batch_b_equal_one_process_of_batch_2b(tmp_path: Path) -> None:
    """Gradient averaging and the data split, proven: same seed, fp32, SGD, no batch norm."""
    common = [
        "task.module.model.norm=none",
        "task.module.scheduler=null",
        "task.module.optimizer.lr=0.01",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        "logger=none",
        "test=false",
    ]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    train(*common, "data.batch_size=64", f"hydra.run.dir={single}", cwd=tmp_path)
    train(
        *common,
        "strategy=ddp",
        "devices=2",
        "data.batch_size=32",
        f"hydra.run.dir={ddp}",
        cwd=tmp_path,
    )
    expected, actual = _final_state(single), _final_state(ddp)
    moved = 0
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-4, atol=1e-5, msg=key)
        moved += int(not torch.equal(value, _initial(key)))
    assert moved > 0


_INITIAL: dict[str, torch.Tensor] = {}


def _initial(key: str) -> torch.Tensor:
    """Weights at step 0 (same seed): the comparison must be about trained weights."""
    if not _INITIAL:
        import lightning as L

        from ddp_template.tasks.image_classification.model import build_resnet

        L.seed_everything(42, verbose=False)
        model = build_resnet(
            "resnet18", num_classes=10, in_channels=1, small_input=True, norm="none"
        )
        _INITIAL.update({f"model.{k}": v for k, v in model.state_dict().items()})
    return _INITIAL[key]


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
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    ddp = results(run_dir)["ddp"]
    assert ddp["bucket_cap_mb"] == 7.0
    assert ddp["static_graph"] is True and ddp["find_unused_parameters"] is False


@pytest.mark.slow
def test_ddp_spawn_runs(run_dir: Path, tmp_path: Path) -> None:
    train(*FAST, "strategy=ddp_spawn", "devices=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert out["world_size"] == 2 and out["strategy"] == "ddp_spawn" and "test/acc" in out
