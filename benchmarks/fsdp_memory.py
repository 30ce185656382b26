"""What each rank holds of a 100M-parameter model (fp32, CPU), `strategy=fsdp` at 1, 2 and 4
ranks beside `strategy=ddp` at 2, printed side by side.

Each setting is one real run of train.py (the regression task's MLP widened to
`--width` x `--layers`, a few steps): parameters, gradients and optimizer state (AdamW)
per rank as results.json's `model_state_mb_over_ranks` measures them after the first step
(a DTensor counts its own shard), and each rank's peak resident memory. Under ddp every
rank holds all of it; under fsdp about 1/W. Writes fsdp_memory.md and fsdp_memory.json into
--out.

    .venv/bin/python benchmarks/fsdp_memory.py --out /tmp/fsdp_memory
    .venv/bin/python benchmarks/fsdp_memory.py --tiny --out /tmp/fsdp_memory   # small model (tests)

Memory, not time, is measured: other work on the machine does not change the figures
(time on a shared machine would need pinned cores); at most 4 training processes run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("ddp", 2)]
PARTS = ("parameters", "gradients", "optimizer_state")


def wide_mlp(width: int, layers: int) -> list[str]:
    """The regression task's MLP as `layers` hidden layers of `width`, plain (no norm, no
    dropout, a constant learning rate): its memory is its parameters, gradients and AdamW."""
    return [
        "task=regression",
        f"task.module.model.hidden=[{','.join([str(width)] * layers)}]",
        "task.module.model.norm=none",
        "task.module.model.dropout=0",
        "task.module.scheduler=null",
    ]


def run(strategy: str, ranks: int, width: int, layers: int, out: Path) -> dict:
    job = out / f"{strategy}_{ranks}"
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        *wide_mlp(width, layers),
        f"strategy={strategy}",
        f"devices={ranks}",
        "accelerator=cpu",
        "data.batch_size=8",
        "trainer.max_steps=2",
        "trainer.max_epochs=-1",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        "callbacks.model_checkpoint=null",
        "callbacks.last_checkpoint=null",
        "test=false",
        "logger=none",
        f"hydra.run.dir={job}",
    ]
    proc = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} x {ranks} failed:\n{proc.stderr[-3000:]}")
    results = json.loads((job / "results.json").read_text())
    return {
        "strategy": strategy,
        "ranks": ranks,
        "model_state_mb_over_ranks": results["model_state_mb_over_ranks"],
        "peak_memory_mb_over_ranks": results["peak_memory_mb_over_ranks"],
    }


def table(rows: list[dict], parameters: int) -> str:
    reference = rows[0]["model_state_mb_over_ranks"]["parameters"]["max"]
    lines = [
        f"Model: {parameters / 1e6:.1f}M parameters, fp32, AdamW; MiB per rank (the largest rank).",
        "",
        "| strategy | ranks | parameters | gradients | optimizer state | model state | x of 1 rank | 1/W | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    whole = sum(rows[0]["model_state_mb_over_ranks"][p]["max"] for p in PARTS)
    for row in rows:
        state = row["model_state_mb_over_ranks"]
        parts = [state[p]["max"] for p in PARTS]
        total = sum(parts)
        peak = row["peak_memory_mb_over_ranks"]["max"]
        lines.append(
            f"| {row['strategy']} | {row['ranks']} | "
            + " | ".join(f"{v:,.1f}" for v in parts)
            + f" | {total:,.1f} | {total / whole:.3f} | {1 / row['ranks'] if row['strategy'] == 'fsdp' else 1:.3f} | {peak:,.0f} |"
        )
    lines.append("")
    lines.append(f"(1 rank's parameters: {reference:,.1f} MiB.)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="a 1,024-wide, 2-layer model")
    parser.add_argument(
        "--settings",
        default=",".join(f"{s}:{r}" for s, r in SETTINGS),
        help="strategy:ranks, comma-separated (the first is the reference)",
    )
    args = parser.parse_args()
    if args.tiny:
        args.width, args.layers = 1024, 2
    args.out.mkdir(parents=True, exist_ok=True)
    # The regression task's default data (diabetes) has 10 features and one output.
    features, width, layers = 10, args.width, args.layers
    parameters = features * width + (layers - 1) * width * width + width * layers + width + 1
    rows = []
    settings = [(s, int(r)) for s, r in (item.split(":") for item in args.settings.split(","))]
    for strategy, ranks in settings:
        rows.append(run(strategy, ranks, width, layers, args.out))
        print(f"{strategy} x {ranks}: {rows[-1]['model_state_mb_over_ranks']}", flush=True)
    text = table(rows, parameters)
    (args.out / "fsdp_memory.md").write_text(text + "\n")
    (args.out / "fsdp_memory.json").write_text(json.dumps(rows, indent=2))
    print(text)


if __name__ == "__main__":
    main()
