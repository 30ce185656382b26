"""How long a sharded checkpoint holds training up: `strategy.async_save=false` against
`true`, 2 ranks of `strategy=fsdp`, side by side in one run.

Each mode trains the regression task's MLP widened to `--width` x `--layers` for a few steps
and saves `last.ckpt` after every step; results.json's `checkpoint_blocked_s` has the
seconds each save kept the training loop waiting (the synchronous save: the whole write and
the rename; the asynchronous one: the copy of each rank's shard, plus the wait for the
previous save when it is still in flight). The modes alternate (`--rounds` times each), so
other work on the machine falls on both alike. Writes fsdp_checkpoint.md into --out.

    .venv/bin/python benchmarks/fsdp_checkpoint.py --out /tmp/fsdp_checkpoint
    .venv/bin/python benchmarks/fsdp_checkpoint.py --tiny --out /tmp/fsdp_checkpoint
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from fsdp_memory import wide_mlp  # beside this script

ROOT = Path(__file__).resolve().parents[1]


def run(async_save: bool, width: int, layers: int, steps: int, job: Path) -> list[float]:
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        *wide_mlp(width, layers),
        "strategy=fsdp",
        f"strategy.async_save={str(async_save).lower()}",
        "devices=2",
        "accelerator=cpu",
        "data.batch_size=8",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        "callbacks.model_checkpoint=null",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "test=false",
        "logger=none",
        f"hydra.run.dir={job}",
    ]
    proc = subprocess.run(command, cwd=job.parent, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"async_save={async_save} failed:\n{proc.stderr[-3000:]}")
    return json.loads((job / "results.json").read_text())["checkpoint_blocked_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a 256-wide, 2-layer model")
    args = parser.parse_args()
    if args.tiny:
        args.width, args.layers, args.steps, args.rounds = 256, 2, 3, 1
    args.out.mkdir(parents=True, exist_ok=True)
    blocked: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for mode in (False, True):
            job = args.out / f"async_{str(mode).lower()}_{round_}"
            # The last save is waited for at the end: the saves during training count.
            blocked[mode] += run(mode, args.width, args.layers, args.steps, job)[:-1]
    sync, asynchronous = (statistics.median(blocked[m]) for m in (False, True))
    features, width, layers = 10, args.width, args.layers
    parameters = features * width + (layers - 1) * width * width + width * layers + width + 1
    text = "\n".join(
        [
            f"Model: {parameters / 1e6:.1f}M parameters, fp32, AdamW; 2 ranks of strategy=fsdp; "
            f"a save after every step; {len(blocked[False])} saves per mode.",
            "",
            "| async_save | training blocked per save, median (s) | min | max | x of synchronous |",
            "|---|---|---|---|---|",
            *(
                f"| {str(mode).lower()} | {statistics.median(blocked[mode]):.3f} | "
                f"{min(blocked[mode]):.3f} | {max(blocked[mode]):.3f} | "
                f"{statistics.median(blocked[mode]) / sync:.2f} |"
                for mode in (False, True)
            ),
        ]
    )
    (args.out / "fsdp_checkpoint.md").write_text(text + "\n")
    print(text)
    print(f"asynchronous / synchronous: {asynchronous / sync:.2f}")


if __name__ == "__main__":
    main()
