"""Trackers of `logger=`: a real MLflow tracking server started here, W&B in offline mode,
TensorBoard event files read back with TensorBoard's own reader, several at once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.runs import FAST, compose_train, free_port, results, train

from ddp_template.errors import ConfigError
from ddp_template.worker.trackers import SERVER_TIMEOUT_S, check_trackers

# FAST without its logger=none; the learning rate logged at every step.
QUICK = [arg for arg in FAST if not arg.startswith("logger=")] + ["trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """`mlflow server` on localhost: a database store and artifacts served by the server."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
        + ["--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # Creating its database takes a while on a busy machine.
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()}")
            time.sleep(0.5)
    yield url
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.mark.slow
def test_mlflow_server_gets_one_run_with_config_metrics_and_results(
    mlflow_server: str, tmp_path: Path, run_dir: Path
) -> None:
    from mlflow.tracking import MlflowClient

    train(
        *QUICK,
        "devices=2",
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={mlflow_server}",
        "logger.mlflow.experiment_name=trackers-test",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("trackers-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "two ranks, one run: only rank 0 writes"
    run = runs[0]
    assert run.data.params["trainer/max_epochs"] == "1"
    assert run.data.params["devices"] == "2"
    assert {"train/loss_step", "train/loss_epoch", "val/acc", "test/acc", "lr-SGD"} <= set(
        run.data.metrics
    )
    artifacts = [entry.path for entry in client.list_artifacts(run.info.run_id)]
    assert "results.json" in artifacts
    copy = client.download_artifacts(run.info.run_id, "results.json", str(tmp_path))
    assert json.loads(Path(copy).read_text()) == results(run_dir)


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_side_by_side(tmp_path: Path, run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        *QUICK,
        "logger=[csv,tensorboard,wandb]",
        "logger.wandb.offline=true",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    outcome = results(run_dir)
    assert (run_dir / "csv" / "metrics.csv").is_file()

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss_step", "train/loss_epoch", "val/acc", "test/acc", "lr-SGD"} <= scalars
    learning_rates = [event.value for event in events.Scalars("lr-SGD")]
    assert len(learning_rates) == 3 and learning_rates[0] != learning_rates[-1]  # OneCycleLR
    text = events.Tensors("results/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f'"global_step": {outcome["global_step"]}' in text

    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert json.loads((offline_run / "files" / "results.json").read_text()) == outcome
    # The run's record log, which `wandb sync` uploads: config, metrics and summary.
    (records,) = offline_run.glob("run-*.wandb")
    log = records.read_bytes()
    assert b'"max_epochs":1' in log and b'"limit_train_batches":3' in log
    assert b"lr-SGD" in log and b"test/acc" in log and b"samples_per_sec" in log


def test_unreachable_mlflow_server_is_refused_within_seconds() -> None:
    """A server that accepts the connection and never answers (the worst case)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = compose_train("logger=mlflow", f"logger.mlflow.tracking_uri={url}")
        start = time.monotonic()
        with pytest.raises(ConfigError) as refused:
            check_trackers(cfg)
        waited = time.monotonic() - start
    assert refused.value.key == "logger.mlflow.tracking_uri"
    assert url in str(refused.value) and "Fix:" in str(refused.value)
    # The check's own timeout, with room for a busy machine; not a hang.
    assert waited < SERVER_TIMEOUT_S + 5


def test_wandb_online_without_an_account_is_refused(monkeypatch, tmp_path: Path) -> None:
    """wandb.init would wait for an API key on a worker's console."""
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(ConfigError, match="logger.wandb.offline=true"):
        check_trackers(compose_train("logger=wandb"))
    check_trackers(compose_train("logger=wandb", "logger.wandb.offline=true"))


def test_learning_rate_monitor_is_left_out_without_a_tracker() -> None:
    from lightning.pytorch.callbacks import LearningRateMonitor

    from ddp_template.build import build_callbacks

    def monitors(*overrides: str) -> int:
        callbacks = build_callbacks(compose_train(*overrides))
        return sum(isinstance(callback, LearningRateMonitor) for callback in callbacks)

    assert monitors() == 1
    assert monitors("logger=none") == 0
