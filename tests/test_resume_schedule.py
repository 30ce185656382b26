"""A schedule counted in steps, resumed at another world size, continues as an
uninterrupted run of the new shape does from the resumed place in the data (docs/resume.md):
the same step count, length and learning rate at every step, inside an epoch and at an
epoch's end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.runs import train

# Diabetes: 310 training rows in batches of 64: 5 steps an epoch on 1 rank, 3 on 2.
BATCH = 64
RUN = [
    "task=regression",
    f"data.batch_size={BATCH}",
    "strategy=ddp",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "test=false",
    "logger=none",
    "~callbacks.model_checkpoint",
    "+callbacks.lr._target_=probe.LearningRates",
]
SCHEDULES = {
    "one-cycle": [],
    "cosine": [
        "task.module.scheduler._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
        "~task.module.scheduler.max_lr",
    ],
}
# The mid-epoch checkpoint: after 128 rows, 2 steps of 1 rank or 1 step of 2 ranks, a place
# both shapes reach at a step boundary.
ROWS_BEFORE = 2 * BATCH


def _steps(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "lr.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four runs of train.py
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)], ids=["1-to-2", "2-to-1"])
def test_a_resume_at_another_world_size_follows_the_schedule_of_that_shape(
    tmp_path: Path, schedule: str, before: int, after: int
) -> None:
    overrides = [*RUN, *SCHEDULES[schedule]]
    stopped = tmp_path / "stopped"
    # One epoch at `before` ranks, saving step.ckpt inside it; last.ckpt is its end.
    train(
        *overrides,
        f"devices={before}",
        "trainer.max_epochs=1",
        "+callbacks.save._target_=probe.SaveAtStep",
        f"+callbacks.save.step={ROWS_BEFORE // (before * BATCH)}",
        f"hydra.run.dir={stopped}",
        cwd=tmp_path,
    )
    reference = tmp_path / "uninterrupted"
    train(
        *overrides,
        f"devices={after}",
        "trainer.max_epochs=2",
        f"hydra.run.dir={reference}",
        cwd=tmp_path,
    )
    expected = _steps(reference)
    per_epoch = len(expected) // 2
    places = {"inside": ROWS_BEFORE // (after * BATCH), "epoch-end": per_epoch}
    for checkpoint, place in (("step.ckpt", "inside"), ("last.ckpt", "epoch-end")):
        resumed = tmp_path / place
        proc = train(
            *overrides,
            f"devices={after}",
            "trainer.max_epochs=2",
            f"ckpt_path={stopped / 'checkpoints' / checkpoint}",
            f"hydra.run.dir={resumed}",
            cwd=tmp_path,
            check=False,
        )
        assert proc.returncode == 0, f"{place}: {proc.stderr[-3000:]}"
        steps, rest = _steps(resumed), expected[places[place] :]
        counted = [(s["scheduler_step"], s["length"]) for s in steps]
        assert counted == [(s["scheduler_step"], s["length"]) for s in rest], place
        # The same values, bit for bit (CosineAnnealingLR computes them recursively).
        assert [s["lr"] for s in steps] == [s["lr"] for s in rest], place
