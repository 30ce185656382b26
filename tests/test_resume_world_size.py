"""Resuming at another world size or batch size continues at the checkpoint's place in the
epoch's sample order: over both attempts every training sample of the interrupted epoch is
trained once. In-process checks of the loader, and real runs that count sample ids."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers.runs import results, train
from torch.utils.data import Dataset

from ddp_template.resume.loader import (
    ResumableDataLoader,
    ResumableDistributedSampler,
    SeededSamples,
)


class _Ids(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _loaders(size: int, world: int, batch: int, workers: int = 0) -> list[ResumableDataLoader]:
    dataset = _Ids(size)
    return [
        ResumableDataLoader(
            SeededSamples(dataset),
            batch_size=batch,
            sampler=ResumableDistributedSampler(
                dataset, num_replicas=world, rank=rank, shuffle=True, seed=3, batch_size=batch
            ),
            num_workers=workers,
        )
        for rank in range(world)
    ]


def _train(loaders: list[ResumableDataLoader], epoch: int, steps: int | None = None) -> list[int]:
    """The ids the ranks' first `steps` batches (all, when None) hold, ranks in lockstep."""
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
    ids: list[int] = []
    iterators = [iter(loader) for loader in loaders]
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            assert all(b is None for b in batches), "ranks ran different numbers of steps"
            break
        ids += [int(i) for batch in batches for i in batch]
        step += 1
    return ids


@pytest.mark.parametrize(
    ("size", "before", "after", "workers"),
    [
        (48, (2, 4), (1, 4), 0),
        (48, (1, 4), (2, 4), 1),
        (48, (2, 4), (3, 5), 0),  # another batch size too; 3 ranks pad the rest's end
        (47, (3, 4), (2, 3), 0),  # every shape pads
    ],
)
def test_a_resume_at_another_world_size_trains_the_rest_of_the_epoch(
    size: int, before: tuple[int, int], after: tuple[int, int], workers: int
) -> None:
    stopped = _loaders(size, *before, workers=workers)
    first = _train(stopped, epoch=5, steps=2)
    states = [loader.state_dict() for loader in stopped]
    assert all(state == states[0] for state in states), "ranks disagree on the position"
    world, batch = before
    assert states[0]["position"] == min(2 * batch * world, size)

    resumed = _loaders(size, *after, workers=workers)
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert resumed[0].continues_epoch
    second = _train(resumed, epoch=5)

    counts = Counter(first + second)
    assert set(counts) == set(range(size)), "samples of the epoch never trained"
    # Only padding repeats a sample: as many as each attempt's padding needs.
    repeats = len(first) + len(second) - size
    padding = (-size) % before[0] + (-(size - states[0]["position"])) % after[0]
    assert repeats <= padding
    assert (stopped[0].samples_trained, resumed[0].samples_trained) == (len(first), len(second))


def test_the_same_world_size_resumes_distributed_samplers_order() -> None:
    """At the same world size and batch size, the continuation is DistributedSampler's own
    order, padding included (what the bit-exact resume relies on)."""
    from torch.utils.data import DistributedSampler

    size, world, batch = 45, 2, 4
    expected = [
        [int(i) for i in DistributedSampler(_Ids(size), world, rank, seed=3)]
        for rank in range(world)
    ]
    stopped = _loaders(size, world, batch)
    _train(stopped, epoch=0, steps=3)
    resumed = _loaders(size, world, batch)
    for rank, loader in enumerate(resumed):
        loader.load_state_dict(stopped[0].state_dict())
        loader.sampler.set_epoch(0)
        assert [int(i) for i in loader.sampler] == expected[rank][3 * batch :]


# One epoch of the diabetes table's 310 training rows, in batches of 64: 3 steps on 2 ranks
# (64 + 64 + 27 rows each), 5 on 1. No padding at either world size.
TRAIN_ROWS = 310
ONE_EPOCH = [
    "task=regression",
    "data.batch_size=64",
    "strategy=ddp",
    "trainer.max_epochs=1",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "test=false",
    "logger=none",
    "~callbacks.model_checkpoint",
    "+callbacks.trained._target_=probe.TrainedSamples",
]


def trained_ids(job: Path) -> list[int]:
    ids: list[int] = []
    for file in (job / "trained").glob("rank_*.jsonl"):
        for line in file.read_text().splitlines():
            ids += json.loads(line)["ids"]
    return ids


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after"),
    # Loader workers in one attempt and not in the other: the position is the batches the
    # training loop took, not those a worker had prefetched.
    [((2, 0), (1, 1)), ((1, 1), (2, 0))],
    ids=["2-to-1-ranks", "1-to-2-ranks"],
)
def test_resumed_at_another_world_size_every_sample_is_trained_once(
    tmp_path: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    stopped, resumed = tmp_path / "stopped", tmp_path / "resumed"
    (world, workers), stop_at = before, 2 if before[0] == 1 else 1
    proc = train(
        *ONE_EPOCH,
        f"devices={world}",
        f"data.num_workers={workers}",
        "+callbacks.stop._target_=faults.StopAfterCheckpoint",
        f"+callbacks.stop.step={stop_at}",
        f"hydra.run.dir={stopped}",
        cwd=tmp_path,
        check=False,
    )
    checkpoint = stopped / "checkpoints" / "last.ckpt"
    assert proc.returncode != 0 and checkpoint.is_file(), proc.stderr[-3000:]

    (world, workers) = after
    proc = train(
        *ONE_EPOCH,
        f"devices={world}",
        f"data.num_workers={workers}",
        f"ckpt_path={checkpoint}",
        f"hydra.run.dir={resumed}",
        cwd=tmp_path,
    )
    counts = Counter(trained_ids(stopped) + trained_ids(resumed))
    assert sorted(counts) == list(range(TRAIN_ROWS)), "rows of the epoch never trained"
    assert set(counts.values()) == {1}, f"rows trained twice: {counts.most_common(3)}"
    record = results(resumed)
    assert record["samples_trained"] == TRAIN_ROWS
    assert [(a["began"], a["world_size"]) for a in record["attempts"]] == [
        ("fresh", before[0]),
        ("ckpt_path", after[0]),
    ]
    assert record["attempts"][1]["start_step"] == stop_at
    # The epoch ended with its last row, and validated as an uninterrupted epoch does.
    assert record["val/mse"] is not None
    output = proc.stdout + proc.stderr
    notes = [
        line for line in output.splitlines() if "from a checkpoint saved at world size" in line
    ]
    assert len(notes) == 1, output[-3000:]


@pytest.mark.slow
def test_resumed_at_another_world_size_from_an_epoch_end(tmp_path: Path) -> None:
    """The end-of-epoch last.ckpt of 2 ranks, resumed on 1 for a second epoch: 3 + 5 steps,
    and the samples of both attempts counted (Lightning restores no loader position at an
    epoch end: the count travels with the attempts)."""
    first, second = tmp_path / "first", tmp_path / "second"
    train(*ONE_EPOCH, "devices=2", f"hydra.run.dir={first}", cwd=tmp_path)
    train(
        *ONE_EPOCH,
        "devices=1",
        "trainer.max_epochs=2",
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
        f"hydra.run.dir={second}",
        cwd=tmp_path,
    )
    record = results(second)
    assert record["global_step"] == 3 + 5
    assert record["samples_trained"] == 2 * TRAIN_ROWS
    assert [(a["world_size"], a["start_step"]) for a in record["attempts"]] == [(2, 0), (1, 3)]
    assert sorted(trained_ids(second)) == list(range(TRAIN_ROWS))


@pytest.mark.parametrize(
    ("batch", "epoch_share", "resumed_batch"),
    [
        # A whole epoch's 24 = 15 + 9 has no batch of one; the resumed 16 = 15 + 1 has.
        (15, 24, 15),
        # A whole epoch's 24 = 23 + 1 leaves its last sample out; the resumed 16 nothing.
        (23, 23, 16),
    ],
)
def test_the_lone_sample_rule_follows_the_resumed_share(
    batch: int, epoch_share: int, resumed_batch: int
) -> None:
    """A BatchNorm model's loader leaves out a batch of one: of the share the resumed epoch
    deals each rank, not of a whole epoch's. 48 samples, 2 steps of 1 rank x 8 leave 32:
    16 for each of 2 ranks."""
    size = 48
    stopped = _loaders(size, 1, 8)
    first = _train(stopped, epoch=0, steps=2)
    dataset = _Ids(size)
    resumed = []
    for rank in range(2):
        sampler = ResumableDistributedSampler(
            dataset, 2, rank, shuffle=True, seed=3, batch_size=batch, drop_lone_sample=True
        )
        assert len(sampler) == epoch_share
        loader = ResumableDataLoader(SeededSamples(dataset), batch_size=batch, sampler=sampler)
        loader.load_state_dict(stopped[0].state_dict())
        resumed.append(loader)
    assert resumed[0].batches_left() == 1
    for loader in resumed:
        loader.sampler.set_epoch(0)
    batches = [[int(i) for i in b] for loader in resumed for b in loader]
    assert [len(ids) for ids in batches] == [resumed_batch, resumed_batch]
    trained = first + [i for ids in batches for i in ids]
    assert len(set(trained)) == len(trained) == 16 + 2 * resumed_batch


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs of train.py
@pytest.mark.parametrize(
    ("batch", "trained"),
    [
        # 2 ranks x 91 rows left in batches of 45: 45 + 45 + 1, the lone row left out. A
        # rule decided from the whole epoch (155 = 3 x 45 + 20) kept it: BatchNorm raised.
        (45, TRAIN_ROWS - 2),
        # Batches of 14: 91 = 6 x 14 + 7, nothing to leave out. A rule decided from the
        # whole epoch (155 = 11 x 14 + 1) dropped the last batch: 7 rows on each rank.
        (14, TRAIN_ROWS),
    ],
    ids=["lone-row-left-out", "nothing-left-out"],
)
def test_a_batchnorm_model_resumed_at_another_world_size_trains_its_share(
    tmp_path: Path, batch: int, trained: int
) -> None:
    """The regression task's model has BatchNorm; 1 rank x 64 stops after 2 steps (128 of
    the 310 rows), 2 ranks resume with another batch size."""
    stopped, resumed = tmp_path / "stopped", tmp_path / "resumed"
    one_epoch = [o for o in ONE_EPOCH if not o.startswith("data.batch_size=")]
    proc = train(
        *one_epoch,
        "data.batch_size=64",
        "devices=1",
        "+callbacks.stop._target_=faults.StopAfterCheckpoint",
        "+callbacks.stop.step=2",
        f"hydra.run.dir={stopped}",
        cwd=tmp_path,
        check=False,
    )
    checkpoint = stopped / "checkpoints" / "last.ckpt"
    assert proc.returncode != 0 and checkpoint.is_file(), proc.stderr[-3000:]
    proc = train(
        *one_epoch,
        f"data.batch_size={batch}",
        "devices=2",
        f"ckpt_path={checkpoint}",
        f"hydra.run.dir={resumed}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = Counter(trained_ids(stopped) + trained_ids(resumed))
    assert set(counts.values()) == {1} and len(counts) == trained
    # 45 + 45 (the lone row left out), or 6 x 14 + 7, on each rank.
    assert results(resumed)["global_step"] == 2 + (2 if batch == 45 else 7)
