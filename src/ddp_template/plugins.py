"""Hydra plugins that some config options need, named before Hydra fails to find them."""

from __future__ import annotations

import importlib.util

from ddp_template.errors import ConfigError

# config option on the command line -> (module of the plugin, package that provides it)
PLUGINS = {
    "launcher=slurm": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "launcher=submitit_local": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "hparams_search=optuna_lr": ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
}


# Launchers that submit jobs, which Hydra uses only for a sweep (-m).
SUBMITTING_LAUNCHERS = ("launcher=slurm", "launcher=submitit_local")


def require_plugins(args: list[str]) -> None:
    for option in SUBMITTING_LAUNCHERS:
        if option in args and not {"-m", "--multirun"} & set(args):
            raise ConfigError(
                "launcher",
                option.split("=")[1],
                "a launcher for sweeps: Hydra submits jobs only with -m (--multirun), "
                "and without it the run would train on this machine",
                f"python train.py -m {option} ...",
            )
    for option, (module, package) in PLUGINS.items():
        if option in args and importlib.util.find_spec(module) is None:
            raise ConfigError(
                option.split("=")[0],
                option.split("=")[1],
                f"an option that needs the Hydra plugin package {package}, not installed here",
                f"pip install {package} (or: pip install -e '.[cluster]')",
            )
