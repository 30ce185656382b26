"""Single-process runs end to end: the default job, every data set, resume, export."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import FAST, results, train

from ddp_template.tasks.image_classification.model import build_resnet


@pytest.mark.slow
def test_default_run_shortened(run_dir: Path, tmp_path: Path) -> None:
    proc = train(*FAST, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert 0.0 <= out["test/acc"] <= 1.0
    assert out["world_size"] == 1 and out["global_batch_size"] == 64
    assert out["precision_used"] == "32-true"
    assert out["samples_per_sec"] > 0 and out["peak_memory_mb"] > 0
    assert out["config"]["data"]["name"] == "digits"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "checkpoints" / "best.ckpt").is_file()
    for line in (
        "world size",
        "global batch",
        "precision",
        "throughput",
        "test/acc",
        "best val/acc",
        str(run_dir),
    ):
        assert line in proc.stdout


@pytest.mark.slow
def test_exported_weights_load_into_the_bare_model(run_dir: Path, tmp_path: Path) -> None:
    train(*FAST, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    state = torch.load(run_dir / "model.pt", weights_only=True, map_location="cpu")
    assert not any(key.startswith(("module.", "model.")) for key in state)
    model = build_resnet("resnet18", num_classes=10, in_channels=1, small_input=True)
    model.load_state_dict(state)  # strict: every key matches
    # The Lightning checkpoints themselves also load without unpickling code.
    torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


@pytest.mark.slow
def test_default_run_reaches_95_percent(run_dir: Path, tmp_path: Path) -> None:
    start = time.perf_counter()
    train(f"hydra.run.dir={run_dir}", cwd=tmp_path)
    elapsed = time.perf_counter() - start
    out = results(run_dir)
    assert out["test/acc"] >= 0.95, out["test/acc"]
    # "A few minutes on 2 CPU cores" (README: 30-40 s idle, measured there): here the other
    # pytest worker runs its own processes on the same cores (233 s once, beside a 5-minute
    # test, on a day the whole machine ran a third slower), so the bound is what the promise
    # needs, not what an idle machine reads.
    assert elapsed < 420, f"default run took {elapsed:.0f}s"


def _last_weights(run_dir: Path, name: str = "last.ckpt") -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / name, weights_only=True, map_location="cpu")
    return ckpt["state_dict"]


@pytest.mark.slow
def test_resumed_run_ends_with_the_same_weights(tmp_path: Path) -> None:
    common = [
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        "logger=none",
        "test=false",
        "trainer.max_epochs=2",
    ]
    # The uninterrupted run keeps its checkpoint after epoch 1: what an interrupted run leaves.
    full = tmp_path / "full"
    train(
        *common,
        f"hydra.run.dir={full}",
        "callbacks.model_checkpoint.filename='epoch{epoch}'",
        "callbacks.model_checkpoint.save_top_k=-1",
        cwd=tmp_path,
    )
    resumed = tmp_path / "resumed"
    train(
        *common,
        f"hydra.run.dir={resumed}",
        f"ckpt_path={full / 'checkpoints' / 'epoch0.ckpt'}",
        cwd=tmp_path,
    )
    expected, actual = _last_weights(full), _last_weights(resumed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    assert results(resumed)["global_step"] == results(full)["global_step"] == 8


def _write_cifar10(root: Path, per_batch: int = 20) -> None:
    """A few images per batch file, in CIFAR-10's own python-pickle format."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(name: str) -> None:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(i % 10) for i in range(per_batch)]
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)

    for i in range(1, 6):
        batch(f"data_batch_{i}")
    batch("test_batch")
    names = [f"class{i}" for i in range(10)]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per_batch}, f)


@pytest.mark.slow
def test_cifar10_files(run_dir: Path, tmp_path: Path) -> None:
    _write_cifar10(tmp_path / "cifar")
    train(
        *FAST,
        "data=cifar10",
        f"data.root={tmp_path / 'cifar'}",
        "data.download=false",
        "data.verify=false",
        "data.batch_size=8",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["config"]["data"]["name"] == "cifar10" and "test/acc" in out


@pytest.mark.slow
def test_image_folder_of_jpegs(run_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("cat", "dog", "fox"):
        folder = tmp_path / "images" / label
        folder.mkdir(parents=True)
        for i in range(12):
            pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg")
    train(
        *FAST,
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "data.image_size=16",
        "data.batch_size=4",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["config"]["data"]["name"] == "imagefolder" and "test/acc" in out


@pytest.mark.slow
def test_synthetic_data_with_accumulation(run_dir: Path, tmp_path: Path) -> None:
    train(
        *FAST,
        "data=synthetic",
        "data.num_samples=64",
        "data.eval_samples=16",
        "data.image_size=8",
        "data.batch_size=8",
        "trainer.accumulate_grad_batches=2",
        "trainer.limit_train_batches=4",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["global_batch_size"] == 16 and out["global_step"] == 2
