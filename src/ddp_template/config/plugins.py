"""The command line, checked before Hydra composes it: the Hydra plugins that some config
options need, named before Hydra fails to find them, and keys that are not in the config,
named with the closest key that is (Hydra's own advice is to add them with `+`)."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from ddp_template.errors import ConfigError, unknown_key_error

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


def check_override_keys(args: list[str], config_dir: str, config_name: str) -> None:
    """`trainer.max_epoch=1`: a key the config does not have. Composes the config the way
    `hydra.main` will (a tenth of a second); whatever else fails is left to Hydra to report."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    parsed, _ = get_args_parser().parse_known_args(args)
    if parsed.config_path or parsed.config_name or parsed.config_dir or parsed.experimental_rerun:
        return
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            compose(config_name, overrides=parsed.overrides)
    except MissingConfigException as err:
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if not group:
            return
        options = list(err.options) if err.options is not None else _options_of(config_dir, group)
        if group == "data":
            raise unknown_data_set(option, options) from None
        raise unknown_group_option(group, option, options) from None
    except ConfigCompositionException as err:
        cause = err.__cause__
        if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
            return
        node = cause.parent_node
        known = [str(key) for key in node] if node is not None else []
        key = str(cause.full_key)
        value = next(
            (arg.split("=", 1)[1] for arg in parsed.overrides if arg.split("=", 1)[0] == key),
            "...",
        )
        raise unknown_key_error(
            key, value, known, f"the config's {key.rpartition('.')[0] or 'top level'}"
        ) from None
    except Exception:  # noqa: BLE001 - Hydra reports these itself, with its own words
        return


def unknown_group_option(group: str, option: str, options: list[str]) -> ConfigError:
    """`strategy=ddpp`: an option of a config group that has no file; its options are the
    files of that group's folder (Hydra's own message is a dozen lines and exit code 1)."""
    listed = ", ".join(options) or "none"
    close = difflib.get_close_matches(option, options, n=1)
    if close:
        fix = f"{group}={close[0]} (the closest), or add conf/{group}/{option}.yaml"
    else:
        fix = f"pick one of those, or add conf/{group}/{option}.yaml"
    return ConfigError(group, option, f"an option of the config group {group}: {listed}", fix)


def _options_of(config_dir: str, group: str) -> list[str]:
    """The options of a group in this project's config tree (Hydra lists none for an entry
    of a list such as `debug=[fast,nope]`)."""
    folder = Path(config_dir) / group
    return sorted(f.stem for f in folder.glob("*.yaml")) if folder.is_dir() else []


def unknown_data_set(name: str, options: list[str] | None) -> ConfigError:
    """`data=shapes` without conf/data/shapes.yaml: the data sets are the files there."""
    return ConfigError(
        "data",
        name,
        f"the name of a file in conf/data/ (each conf/data/<name>.yaml is one data set): "
        f"{', '.join(options or []) or 'none'}",
        f"pick one of those, or add conf/data/{name}.yaml whose `source` names the class that "
        "reads it in the task's sources.py (docs/data.md)",
    )
