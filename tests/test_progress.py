"""Progress in logs: with stdout going to a file (a SLURM log), rank 0 prints progress lines
during an epoch; training metrics are logged per step as well as per epoch."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from helpers.runs import compose_train, train

from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError

# epoch 1/1  step 2/6 (33%)  loss 2.402  18 samples/s  0.00371 TFLOP/s per device
#   left: epoch 0:14, run 0:36   (one line; on the CPU no MFU)
LINE = re.compile(
    r"^(?:\[rank0\] )?epoch (\d+)(?:/(\d+))?  step (\d+)/(\d+) \(\d+%\)  loss [\d.e+-]+  "
    r"[\d,]+ samples/s  [\d.e+-]+ TFLOP/s per device  left: epoch \d+:\d\d, run \d+:\d\d$"
)
RUN = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
]


def progress_lines(text: str) -> list[re.Match]:
    return [m for m in map(LINE.match, text.splitlines()) if m]


@pytest.mark.slow
def test_a_log_file_shows_progress_lines_during_an_epoch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(
        *[o for o in RUN if not o.startswith("trainer.enable_model_summary")],
        "callbacks.progress.every_n_steps=2",
        "callbacks.progress.every_s=null",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    lines = proc.stdout.splitlines()
    steps = [int(m.group(3)) for m in progress_lines(proc.stdout)]
    assert steps == [2, 4, 6], proc.stdout[-3000:]
    # The CPU has no peak in the table: FLOP/s without an MFU.
    assert "MFU" not in proc.stdout
    # The model summary shows a training batch's FLOPs (Lightning's own printed 0).
    (flops,) = re.findall(r"^([\d.]+) ([KMBT]?) *Total Flops$", proc.stdout, re.MULTILINE)
    assert float(flops[0]) > 0 and flops[1] in "KMBT"
    assert all(m.group(4) == "6" for m in progress_lines(proc.stdout))
    # The lines come during the epoch, before its summary line.
    summary = next(i for i, line in enumerate(lines) if line.startswith("epoch 1/1  train/"))
    assert max(i for i, line in enumerate(lines) if LINE.match(line)) < summary
    # Per-step rows in the metrics file, besides the per-epoch ones.
    (metrics_file,) = run_dir.glob("**/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    assert sum(1 for row in rows if row.get("train/loss_step")) == 6
    assert sum(1 for row in rows if row.get("train/loss_epoch")) == 1


@pytest.mark.slow
def test_two_ranks_print_progress_by_time_on_rank_0_only(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(
        *RUN,
        # A step limit ends the second epoch after 2 of its 6 steps.
        "trainer.max_epochs=-1",
        "trainer.max_steps=8",
        "logger=none",
        "strategy=ddp",
        "devices=2",
        "callbacks.progress.every_n_steps=null",
        # Shorter than any step: a line after every step.
        "callbacks.progress.every_s=0.001",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    steps = [(int(m.group(3)), int(m.group(4))) for m in progress_lines(proc.stdout)]
    assert steps == [(step, 6) for step in range(1, 7)] + [(1, 2), (2, 2)], proc.stdout[-3000:]
    rank1 = (run_dir / "logs" / "attempt_0" / "1" / "stdout.log").read_text()
    assert not progress_lines(rank1) and "step 1/" not in rank1


@pytest.mark.parametrize(
    "override", ["callbacks.progress.every_n_steps=0", "callbacks.progress.every_s=-1"]
)
def test_bad_interval_is_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(override.split("=")[0])):
        resolve_and_check(compose_train(override))
