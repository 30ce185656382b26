"""Lightning + Hydra template where data-parallel training is correct, fast and debuggable."""

__version__ = "0.1.0"
