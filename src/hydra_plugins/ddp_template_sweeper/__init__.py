"""Hydra sweepers of ddp_template (Hydra finds sweepers only in this namespace)."""
