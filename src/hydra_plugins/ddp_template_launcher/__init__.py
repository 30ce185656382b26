"""Hydra launchers of ddp_template (Hydra finds launchers only in this namespace)."""
