"""Train: `python train.py [overrides]`, e.g. `python train.py strategy=ddp devices=4`."""

from ddp_template.train import cli

if __name__ == "__main__":
    cli()
