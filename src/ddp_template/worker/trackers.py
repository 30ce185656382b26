"""What every tracker of `logger=` receives besides the metrics Lightning logs: the resolved
config as hyper-parameters when the run starts, and the run's results when it ends.

Lightning's loggers write on rank 0 only (their methods are `rank_zero_only`); the results
exist on rank 0 alone.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import numbers
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from omegaconf import DictConfig

from ddp_template.errors import ConfigError

# The package each tracker writes with (`pip install -e ".[trackers]"` brings them all).
PACKAGES = {"TensorBoardLogger": "tensorboard", "MLFlowLogger": "mlflow", "WandbLogger": "wandb"}
# How long the launching process waits for a tracking server before refusing the run.
SERVER_TIMEOUT_S = 3.0


def check_trackers(cfg: DictConfig) -> None:
    """Before any worker starts: each tracker's package is installed, an MLflow server
    answers, and W&B has an account to write to or runs offline. Opens no run."""
    for name, node in (cfg.get("logger") or {}).items():
        if not node:
            continue
        kind = str(node._target_).rsplit(".", 1)[-1]
        package = PACKAGES.get(kind)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                "logger",
                name,
                f"the {package} package, which is not installed",
                'pip install -e ".[trackers]"',
            )
        if kind == "MLFlowLogger":
            _check_mlflow_server(f"logger.{name}.tracking_uri", node.get("tracking_uri"))
        if kind == "WandbLogger" and not node.get("offline"):
            _check_wandb_account(f"logger.{name}.offline")


def _check_mlflow_server(key: str, uri: str | None) -> None:
    if not uri or urlparse(uri).scheme not in ("http", "https"):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=SERVER_TIMEOUT_S):
            return
    except urllib.error.HTTPError:
        return  # a server answered, if not at this path: MLflow reports anything else itself
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
    raise ConfigError(
        key,
        uri,
        f"the address of a running MLflow tracking server; none answered there within "
        f"{SERVER_TIMEOUT_S:g} s ({reason})",
        "start one (mlflow server --host 127.0.0.1 --port 5000), correct the address, or "
        "unset MLFLOW_TRACKING_URI to write to sqlite:///mlflow.db",
    )


def _check_wandb_account(key: str) -> None:
    """wandb.init would ask for an API key on the console of a worker, which nobody sees."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled") or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        # typeshed wants a str; a None host is looked up like an unknown one (the
        # `default` entry), as it is here when WANDB_BASE_URL has no host.
        if netrc.netrc().authenticators(host):  # type: ignore[arg-type]
            return
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    raise ConfigError(
        key,
        False,
        f"an account to write to: no WANDB_API_KEY and no `wandb login` for {host}",
        "log in (wandb login), or run offline: logger.wandb.offline=true or WANDB_MODE=offline",
    )


def log_config(loggers: list[Logger], config: dict[str, Any]) -> None:
    """The resolved config, nested keys joined by "/" (`trainer/max_epochs`)."""
    for logger in loggers:
        logger.log_hyperparams(config)


def attach_results(loggers: list[Logger], results_file: Path, results: dict[str, Any]) -> None:
    """results.json as the run's artifact (MLflow), file and summary (W&B) or text
    (TensorBoard, with the final metrics beside the hyper-parameters in its HParams tab)."""
    final = {key: value for key, value in _flat(results).items() if _is_number(value)}
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, str(results_file))
        elif isinstance(logger, WandbLogger):
            run = logger.experiment
            run.summary.update(final)
            run.save(str(results_file), base_path=str(results_file.parent), policy="now")
            # Closes the run now: its files are complete when the job returns.
            run.finish()
        elif isinstance(logger, TensorBoardLogger):
            text = json.dumps(results, indent=2, default=str)
            logger.experiment.add_text("results", f"```\n{text}\n```")
            metrics = {f"results/{key}": value for key, value in final.items()}
            logger.log_hyperparams(results.get("config", {}), metrics=metrics)
            logger.experiment.flush()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if key == "config":
            continue
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
