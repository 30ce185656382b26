"""What the template promises every task, checked for each task of the project (a task made
with `new_task` included, found as `new_task` finds them) from three real runs:

- `full`: 2 ranks of B samples, 2 epochs of 3 steps, then the test;
- `stopped`: 1 process of 2B samples, the same config, ended after step 4 (mid-epoch 2);
- `resumed`: 2 ranks of B samples, resumed from `stopped`'s checkpoint.

From `full`: every rank holds the same weights after training, training shards are disjoint,
the evaluation counts every test sample once and its metrics equal those of one process on
the checkpoint, and only rank 0 writes the job's files. `resumed` against `full`: 1 x 2B for
the first 4 steps and 2 x B after the resume end where 2 x B all along did, which needs both
2 x B == 1 x 2B (gradient averaging over a split batch) and resume == uninterrupted.
Batch norm and dropout are held in eval mode while training (probe.BatchIndependent): with
them a batch's statistics and masks depend on how it is split. The optimizer keeps its kind,
at a small constant learning rate: the TaskModule contract (task.module.optimizer and
scheduler) is all the test assumes of a task."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.runs import ROOT, compose_train, probes, results, train

from ddp_template.build import build_task
from ddp_template.new_task import available_sources

TASKS = available_sources(ROOT)
COMMON = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
    "+callbacks.batch_independent._target_=probe.BatchIndependent",
    # Small, constant steps: float rounding, which differs between a batch of 2B and two of
    # B, grows with the step size over the six steps (at the image task's own lr 0.1 with
    # one-cycle, to 1.8e-4 on weights of 0.33).
    "++task.module.optimizer.lr=0.01",
    "task.module.scheduler=null",
]
STOP_AT_STEP = 4
TWO_RANKS = ["strategy=ddp", "devices=2"]


def final_state(job: Path) -> dict[str, torch.Tensor]:
    """The module's state at the end of training (model.pt may hold the best epoch's)."""
    path = job / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("task", TASKS)
def test_every_task_gets_what_ddp_promises(task: str, tmp_path: Path) -> None:
    cfg = compose_train(f"task={task}")
    batch = int(cfg.data.batch_size)
    datamodule, _ = build_task(cfg)
    sizes = datamodule.split_sizes()
    assert sizes is not None, "the task's default data set is counted before training"
    train_size, _, test_size = sizes
    common = [f"task={task}", *COMMON]
    full, stopped, resumed = (tmp_path / name for name in ("full", "stopped", "resumed"))

    train(
        *common,
        *TWO_RANKS,
        "+callbacks.probe._target_=probe.Probe",
        f"hydra.run.dir={full}",
        cwd=tmp_path,
    )
    ranks = probes(full)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
    assert ranks[0]["weights_abs_sum"] == ranks[1]["weights_abs_sum"]
    for epoch in ("0", "1"):
        shards = [r["train"][epoch] for r in ranks]
        assert len(shards[0]) == len(shards[1])
        together = Counter(shards[0] + shards[1])
        assert set(together) == set(range(train_size))
        # Only the padding that evens the shards repeats a sample.
        assert sum(c - 1 for c in together.values()) == 2 * len(shards[0]) - train_size
    assert ranks[0]["train"]["0"] != ranks[0]["train"]["1"], "not reshuffled between epochs"
    assert sorted(ranks[0]["test"] + ranks[1]["test"]) == list(range(test_size))
    assert sum(r["test_samples_seen"] for r in ranks) == test_size
    _assert_test_metrics_equal_one_process(cfg, results(full))
    _assert_only_rank_zero_wrote(full, batch)

    proc = train(
        *common,
        f"data.batch_size={2 * batch}",
        "test=false",
        "+callbacks.stop._target_=faults.StopAfterCheckpoint",
        f"+callbacks.stop.step={STOP_AT_STEP}",
        f"hydra.run.dir={stopped}",
        cwd=tmp_path,
        check=False,
    )
    checkpoint = stopped / "checkpoints" / "last.ckpt"
    assert proc.returncode != 0 and checkpoint.is_file(), proc.stderr[-3000:]
    train(
        *common,
        *TWO_RANKS,
        "test=false",
        f"ckpt_path={checkpoint}",
        f"hydra.run.dir={resumed}",
        cwd=tmp_path,
    )
    attempts = results(resumed)["attempts"]
    assert [(a["start_step"], a["world_size"]) for a in attempts] == [(0, 1), (STOP_AT_STEP, 2)]
    expected, actual = final_state(full), final_state(resumed)
    at_stop = torch.load(checkpoint, weights_only=True, map_location="cpu")["state_dict"]
    assert expected.keys() == actual.keys()
    # The two ends differ by float rounding alone (a batch of 2B sums in another order than
    # two of B), far less than the two steps after the stop moved the weights: a resume that
    # repeated or skipped samples, lost the optimizer's state, or gradients summed instead of
    # averaged would differ by about that much. (Measured: 0.9% for the image task's ResNet,
    # whose unnormalised layers grow rounding fastest;
    # the same resume on another data order, seed=7: 46%.)
    difference = _distance(actual, expected)
    moved = _distance(expected, at_stop)
    assert moved > 0, "no training after the stop"
    assert difference <= 0.05 * moved, (
        f"ends {difference:.3g} apart; the last steps moved {moved:.3g}"
    )


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Euclidean distance between two states, over every floating-point tensor."""
    keys = [key for key in a if a[key].is_floating_point()]
    return float(torch.cat([(a[k].double() - b[k].double()).reshape(-1) for k in keys]).norm())


def _assert_test_metrics_equal_one_process(cfg, out: dict) -> None:
    """The reported test metrics are those of the checkpoint on the whole test set, counted
    once: one process testing the same checkpoint gets them too."""
    import lightning as L
    from hydra.utils import get_class

    module_class = get_class(cfg.task.module._target_)
    module = module_class.load_from_checkpoint(out["checkpoints"]["best"], weights_only=True)
    datamodule, _ = build_task(cfg)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (single,) = trainer.test(module, datamodule=datamodule, verbose=False)
    assert single, "the task logs no test metric"
    for name, value in single.items():
        assert value == pytest.approx(out[name], rel=1e-5, abs=1e-6), name


def _assert_only_rank_zero_wrote(job: Path, batch: int) -> None:
    out = results(job)
    assert out["world_size"] == 2 and out["global_batch_size"] == 2 * batch
    assert sorted(p.name for p in job.parent.iterdir()) == ["full"]
    for rank in (0, 1):
        assert (job / "logs" / "attempt_0" / str(rank) / "stderr.log").is_file()
    # last.prev.ckpt: the epoch-1 last.ckpt, kept until the epoch-2 one was complete.
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == [
        "best.ckpt",
        "last.ckpt",
        "last.prev.ckpt",
    ]
