"""Images per second of the training DataLoader alone (no model), for `loader=` settings on a
folder of images; and a folder of random JPEGs to measure it on.

    .venv/bin/python benchmarks/loader_throughput.py write /tmp/jpegs --count 3000
    .venv/bin/python benchmarks/loader_throughput.py measure /tmp/jpegs --loader baseline tuned

`measure` builds the loader exactly as a run of `train.py data=imagefolder data.root=<folder>
loader=<name>` does (decoding, random crops, workers, pinned memory), reads a few batches to
start the workers, then times `--batches` batches from a fresh pass, copies to the GPU
included on CUDA. It prints one JSON object per loader.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_jpegs(
    root: Path, count: int, classes: int, min_size: int, max_size: int, seed: int = 0
) -> int:
    """`count` JPEGs of random sizes in `classes` sub-folders of `root`, written in parallel."""
    jobs = [(root / f"class_{i % classes}" / f"{i:06d}.jpg", seed + i) for i in range(count)]
    for folder in {path.parent for path, _ in jobs}:
        folder.mkdir(parents=True, exist_ok=True)
    sizes = [(min_size, max_size)] * count
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write_one, jobs, sizes, chunksize=32))
    return count


def _write_one(job: tuple[Path, int], size_range: tuple[int, int]) -> None:
    from PIL import Image

    path, seed = job
    rng = np.random.default_rng(seed)
    width, height = (int(v) for v in rng.integers(size_range[0], size_range[1] + 1, size=2))
    # Smooth colour fields plus noise: decodes like a photo, not like flat colour.
    base = rng.integers(0, 256, size=(height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
    pixels = np.kron(base, np.ones((16, 16, 1), dtype=np.uint8))[:height, :width]
    noise = rng.integers(-20, 21, size=pixels.shape)
    pixels = np.clip(pixels.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=90)


def build_loader(root: Path, loader: str, accelerator: str, batch_size: int, image_size: int):
    """The training DataLoader of `train.py data=imagefolder loader=<loader>`, and its config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ddp_template.build import build_task
    from ddp_template.config import resolvers
    from ddp_template.config.checks import resolve_and_check
    from ddp_template.train import CONFIG_DIR

    resolvers.register()
    overrides = [
        "data=imagefolder",
        f"data.root={root}",
        f"loader={loader}",
        f"accelerator={accelerator}",
        f"data.batch_size={batch_size}",
        f"data.image_size={image_size}",
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.paths.output_dir = str(root)
    resolve_and_check(cfg)
    datamodule, _ = build_task(cfg)
    datamodule.setup("fit")
    return datamodule.train_dataloader(), cfg


def measure(
    root: Path, loader: str, accelerator: str, batches: int, batch_size: int, image_size: int
) -> dict:
    import torch

    data_loader, cfg = build_loader(root, loader, accelerator, batch_size, image_size)
    device = torch.device("cuda" if cfg.accelerator == "cuda" else "cpu")
    available = len(data_loader)
    timed = max(1, min(batches, available))

    def read(count: int) -> int:
        images = 0
        for index, (inputs, _labels) in enumerate(data_loader):
            if index == count:
                break
            inputs = inputs.to(device, non_blocking=True)
            images += len(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return images

    start = time.perf_counter()
    read(min(2, available))  # starts the workers (persistent ones stay) and warms the files
    first_pass_s = time.perf_counter() - start
    start = time.perf_counter()
    images = read(timed)
    seconds = time.perf_counter() - start
    return {
        "loader": loader,
        "images_per_sec": images / seconds,
        "images": images,
        "seconds": seconds,
        "warmup_seconds": first_pass_s,
        "batch_size": batch_size,
        "num_workers": int(cfg.data.num_workers),
        "pin_memory": bool(cfg.data.pin_memory),
        "prefetch_factor": cfg.data.prefetch_factor,
        "persistent_workers": bool(cfg.data.persistent_workers),
        "device": device.type,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="a folder of random JPEGs")
    write.add_argument("root", type=Path)
    write.add_argument("--count", type=int, default=3000)
    write.add_argument("--classes", type=int, default=10)
    write.add_argument("--min-size", type=int, default=256)
    write.add_argument("--max-size", type=int, default=500)
    read = commands.add_parser("measure", help="images/s of the training loader alone")
    read.add_argument("root", type=Path)
    read.add_argument("--loader", nargs="+", default=["baseline", "tuned"])
    read.add_argument("--accelerator", default="auto")
    read.add_argument("--batches", type=int, default=10)
    read.add_argument("--batch-size", type=int, default=128)
    read.add_argument("--image-size", type=int, default=224)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "write":
        written = write_jpegs(args.root, args.count, args.classes, args.min_size, args.max_size)
        print(json.dumps({"written": written, "root": str(args.root)}), flush=True)
        return 0
    for loader in args.loader:
        record = measure(
            args.root, loader, args.accelerator, args.batches, args.batch_size, args.image_size
        )
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
