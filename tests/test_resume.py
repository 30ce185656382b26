"""Resuming is exact: a 2-rank run stopped mid-epoch and resumed from its checkpoint ends
with the same weights, bit for bit, as a run that was never stopped (with PowerSGD, to
rounding); and every rank draws
its own random numbers. Every test runs real processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import train
from PIL import Image

# Two epochs of four steps; the stopped run ends after step 6, in the middle of epoch 2.
TWO_RANKS = [
    "strategy=ddp",
    "devices=2",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=1",
    "trainer.enable_model_summary=false",
    "test=false",
    "logger=none",
    # last.ckpt is what resuming needs; best.ckpt would only add writing time.
    "~callbacks.model_checkpoint",
]
STOP_AT_STEP = 6
# Three 2-rank runs; each takes seconds alone, minutes on a machine shared with other work.
THREE_RUNS = pytest.mark.timeout(1800)


def image_folder(root: Path, classes: int = 2, per_class: int = 40) -> Path:
    """Class folders of one and the same 8x8 picture: any difference between two training
    samples comes from random augmentation."""
    picture = (np.random.default_rng(0).random((8, 8, 3)) * 255).astype(np.uint8)
    for label in range(classes):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(picture).save(folder / f"{i}.png")
    return root


def augmented_with_dropout(root: Path) -> list[str]:
    """Random crops and flips (the image folder's training transform) and dropout."""
    return [
        "data=imagefolder",
        f"data.root={image_folder(root)}",
        "data.image_size=8",
        "data.batch_size=8",
        "task.module.model.dropout=0.3",
        # Lightning re-seeds every generator after its sanity check: resume must not care.
        "trainer.num_sanity_val_steps=1",
    ]


def final_weights(job: Path) -> dict[str, torch.Tensor]:
    return torch.load(job / "model.pt", weights_only=True, map_location="cpu")


def assert_same_weights(resumed: Path, uninterrupted: Path) -> None:
    a, b = final_weights(resumed), final_weights(uninterrupted)
    assert a.keys() == b.keys()
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{len(differing)} of {len(a)} tensors differ, e.g. {differing[:3]}"


def stop_and_resume(tmp_path: Path, overrides: list[str]) -> tuple[Path, Path]:
    """(resumed job, uninterrupted job) of the same config."""
    uninterrupted, stopped, resumed = (tmp_path / name for name in ("full", "stopped", "resumed"))
    train(*overrides, f"hydra.run.dir={uninterrupted}", cwd=tmp_path)

    proc = train(
        *overrides,
        "+callbacks.stop._target_=faults.StopAfterCheckpoint",
        f"+callbacks.stop.step={STOP_AT_STEP}",
        f"hydra.run.dir={stopped}",
        cwd=tmp_path,
        check=False,
    )
    checkpoint = stopped / "checkpoints" / "last.ckpt"
    assert proc.returncode != 0 and checkpoint.is_file(), proc.stderr[-3000:]
    # weights_only refuses any class outside torch's few plain types: the checkpoint names no
    # module of this project, so moving a module never stops an old checkpoint from loading.
    assert torch.load(checkpoint, weights_only=True)["global_step"] == STOP_AT_STEP
    assert not (stopped / "model.pt").exists()

    train(*overrides, f"ckpt_path={checkpoint}", f"hydra.run.dir={resumed}", cwd=tmp_path)
    # A resume, not a retrain that ignored the checkpoint (it would end with the same
    # weights too, from the same seed).
    attempts = json.loads((resumed / "results.json").read_text())["attempts"]
    assert [(a["began"], a["start_step"], a["world_size"]) for a in attempts] == [
        ("fresh", 0, 2),
        ("ckpt_path", STOP_AT_STEP, 2),
    ]
    return resumed, uninterrupted


@pytest.mark.slow
@THREE_RUNS
def test_digits_with_powersgd_resume_to_rounding(tmp_path: Path, monkeypatch) -> None:
    """Data order mid-epoch, and PowerSGD's error feedback (kept as the ranks' mean) and
    warm-start factors (compression starts at step 3), carried over although the resumed
    process forms its own buckets. The mean gives the same computation in exact arithmetic;
    the ranks' sums then add in another order, so the weights agree to rounding: their
    difference is a millionth of what the two resumed steps changed (measured here: 1.0e-6,
    largest element 6e-8), where a lost or altered error feedback changes the compressed
    gradient itself.

    PowerSGD multiplies gradient matrices where they lie in DDP's buckets; MKL's results
    depend on their memory alignment, which changes with the buckets, unless MKL is asked
    for results that do not (docs/resume.md)."""
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    overrides = [*TWO_RANKS, "data=digits", "data.batch_size=16", "strategy.comm_hook=powersgd"]
    resumed, uninterrupted = stop_and_resume(tmp_path, overrides)
    saved = torch.load(tmp_path / "stopped" / "checkpoints" / "last.ckpt", weights_only=True)
    a, b = final_weights(resumed), final_weights(uninterrupted)
    learned = [k for k in b if b[k].is_floating_point() and f"model.{k}" in saved["state_dict"]]
    apart = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in learned)
    moved = sum(
        float((b[k].double() - saved["state_dict"][f"model.{k}"].double()).pow(2).sum())
        for k in learned
    )
    assert moved > 0 and (apart / moved) ** 0.5 < 1e-4, (apart, moved)
    record = json.loads((resumed / "results.json").read_text())
    assert record["global_step"] == 8 and record["resumed_from"].endswith("last.ckpt")


@pytest.mark.slow
@THREE_RUNS
def test_augmentation_and_dropout_resume_exactly(tmp_path: Path) -> None:
    overrides = [*TWO_RANKS, *augmented_with_dropout(tmp_path / "images")]
    resumed, uninterrupted = stop_and_resume(tmp_path, overrides)
    assert_same_weights(resumed, uninterrupted)


@pytest.mark.slow
def test_each_rank_draws_its_own_augmentation_and_dropout(tmp_path: Path) -> None:
    job = tmp_path / "run"
    train(
        *TWO_RANKS,
        *augmented_with_dropout(tmp_path / "images"),
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "+callbacks.draws._target_=probe.RandomDrawProbe",
        f"hydra.run.dir={job}",
        cwd=tmp_path,
    )
    rank0, rank1 = (json.loads((job / "draws" / f"rank_{r}.json").read_text()) for r in (0, 1))
    # Every sample is the same picture: the batches differ only by their augmentation.
    assert len(set(rank0["image_sums"])) > 1, "no random augmentation at all"
    assert rank0["image_sums"] != rank1["image_sums"]
    assert rank0["dropout_draw"] != rank1["dropout_draw"]


class _RandomlyAugmented(torch.utils.data.Dataset):
    """Sample i plus noise drawn from the generator augmentation uses."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)]) + torch.rand(1)


def _loader(rank: int, workers: int):
    from ddp_template.resume.loader import (
        ResumableDataLoader,
        ResumableDistributedSampler,
        SeededSamples,
    )

    dataset = _RandomlyAugmented()
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=2, rank=rank, shuffle=True, seed=7, batch_size=4
    )
    return ResumableDataLoader(
        SeededSamples(dataset), batch_size=4, sampler=sampler, num_workers=workers
    )


def test_loader_resumes_after_the_batches_taken_with_the_same_augmentation() -> None:
    """In-process check of the loader alone: the position and the per-batch seeds, with and
    without worker processes (which prefetch batches the loop has not taken)."""
    full = _loader(rank=1, workers=0)
    full.sampler.set_epoch(3)
    expected = [batch.tolist() for batch in full]

    stopped = _loader(rank=1, workers=2)
    stopped.sampler.set_epoch(3)
    batches = iter(stopped)
    taken = [next(batches).tolist() for _ in range(2)]
    state = stopped.state_dict()
    # 2 batches of 4 on each of 2 ranks: the first 16 samples of the epoch's order.
    assert state == {
        "epoch": 3,
        "position": 16,
        "world_size": 2,
        "batch_size": 4,
    }

    resumed = _loader(rank=1, workers=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(3)
    assert taken + [batch.tolist() for batch in resumed] == expected

    # Rank 0 draws other noise for its first batch.
    rank_zero = _loader(rank=0, workers=0)
    rank_zero.sampler.set_epoch(3)
    first = next(iter(rank_zero))
    assert (first % 1).tolist() != (torch.tensor(expected[0]) % 1).tolist()
