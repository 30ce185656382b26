"""One run, top to bottom: compose -> check -> launch -> fit, test -> results.

`python train.py <overrides>` lands in `main`. The config is checked in the launching
process; each worker (one per device) then runs `fit_and_test` on the resolved config.
"""

from __future__ import annotations

from ddp_template.launch import process_defaults  # noqa: F401  (first: before torch loads)

# isort: split

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException

from ddp_template.config import resolvers
from ddp_template.errors import UserFacingError
from ddp_template.launch.agent import record_failures
from ddp_template.project import CONFIG_DIR

resolvers.register()


def cli() -> None:
    """`python train.py ...`: names a missing launcher plugin, or a key the config does not
    have, before Hydra composes."""
    from ddp_template.config.plugins import check_override_keys, require_plugins

    try:
        require_plugins(sys.argv[1:])
        check_override_keys(sys.argv[1:], CONFIG_DIR, "train")
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run(cfg)


def run(cfg: DictConfig) -> float | None:
    """Checks the config, starts the workers and returns the metric a sweep optimises."""
    from ddp_template.config.checks import resolve_and_check
    from ddp_template.launch.agent import launch, single_threaded
    from ddp_template.resume.folder import finished_results
    from ddp_template.worker.results import print_summary

    if cfg.get("dry_run"):
        return _dry_run(cfg)
    finished = finished_results(Path(cfg.paths.output_dir)) if cfg.get("resume") else None
    if finished is not None:
        # A job of a resumed sweep that finished before: its results, as they were.
        print(f"{cfg.paths.output_dir} finished before (resume=true): not run again", flush=True)
        print_summary(finished)
        return finished.get(cfg.optimized_metric)
    try:
        with single_threaded():
            resolve_and_check(cfg)
        config = OmegaConf.to_container(cfg, resolve=True)
        results = launch(
            fit_and_test,
            config,
            nproc_per_node=processes_per_node(cfg),
            job_dir=Path(cfg.paths.output_dir),
            max_restarts=cfg.max_restarts,
            nodes=own_agent_nodes(cfg),
        )
    except UserFacingError as err:
        return _report(err)
    except SignalException as stop:
        _stopped_by_signal(cfg, stop.sigval)
    if not results:
        return None
    print_summary(results)
    return results.get(cfg.optimized_metric)


def _dry_run(cfg: DictConfig) -> None:
    """`debug=dry_run`: the plan at the configured size instead of a run (docs/dry_run.md)."""
    from ddp_template.config.dry_run import DRY_RUN_FILE, plan
    from ddp_template.config.dry_run_report import report_lines

    try:
        # No worker is forked after it: the checks and the timed step may use every thread.
        figures = plan(cfg)
    except UserFacingError as err:
        return _report(err)
    for line in report_lines(figures, str(Path(cfg.paths.output_dir) / DRY_RUN_FILE)):
        print(line)
    return None


def _stopped_by_signal(cfg: DictConfig, signum: int) -> None:
    """Ctrl-C or SIGTERM: the workers saved and stopped; one line says how to resume (the
    same command in the same folder, `resume=true`: as if it had never stopped). A sweep
    stops too (its other jobs would be interrupted the same way): the line gives the
    command that continues the whole sweep."""
    from ddp_template.resume.preemption import interrupted_message, interrupted_sweep_message

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep_dir = Path(HydraConfig.get().sweep.dir)
        print(f"error: {interrupted_sweep_message(signum, sweep_dir)}", file=sys.stderr)
        sys.exit(128 + int(signum))
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    line = interrupted_message(signum, Path(cfg.paths.output_dir), overrides)
    print(f"error: {line}", file=sys.stderr)
    sys.exit(128 + int(signum))


def own_agent_nodes(cfg: DictConfig):
    """The nodes of a job this project's agent starts on each machine (`network.node_rank`,
    `network.master_addr`); None for one node or an external launcher."""
    from ddp_template.launch.agent import Nodes, processes_started_externally
    from ddp_template.launch.network import choose_endpoint

    network = cfg.network
    if cfg.num_nodes == 1 or processes_started_externally():
        return None
    endpoint = choose_endpoint(
        network.master_addr, network.node_rank, cfg.num_nodes, network.interface
    )
    return Nodes(
        count=int(cfg.num_nodes),
        rank=int(network.node_rank),
        master_addr=str(network.master_addr),
        master_port=int(network.master_port),
        job_id=Path(cfg.paths.output_dir).name,
        local_addr=endpoint.address,
        timeout_s=float(network.timeout_s),
    )


def processes_per_node(cfg: DictConfig) -> int:
    """Workers this job starts itself; ddp_spawn starts its own, one process does not."""
    if cfg.strategy.name == "ddp_spawn":
        return 1
    return int(cfg.devices)


def _report(err: UserFacingError) -> None:
    """A single run exits with the message alone; in a sweep the job fails, the rest go on."""
    details = getattr(err, "details", "")
    if details:
        print(details, file=sys.stderr)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        # Hydra records the failed job, runs the others and exits non-zero at the end.
        raise err.with_traceback(None) from None
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


@record_failures
def fit_and_test(config: dict[str, Any]) -> dict[str, Any] | None:
    """What every rank runs. Returns rank 0's results (None on the other ranks)."""
    from ddp_template.debug import apply_debug_environment

    cfg = OmegaConf.create(config)
    # Before the process group starts: PyTorch reads these switches from the environment.
    apply_debug_environment(cfg)
    with _cpu_threads(int(cfg.devices)):
        return _fit_and_test(cfg)


def _fit_and_test(cfg: DictConfig) -> dict[str, Any] | None:
    import lightning as L

    from ddp_template.build import build_task, build_trainer
    from ddp_template.callbacks.ddp_settings import DDPSettingsMonitor
    from ddp_template.debug import explain_unused_parameters
    from ddp_template.launch.leaving import leave_process_group
    from ddp_template.resume.attempts import attempts_summary, requeue_count, restart_count
    from ddp_template.resume.decision import resume_point
    from ddp_template.worker.compiling import compile_if_asked
    from ddp_template.worker.node_agreement import nodes_of_job
    from ddp_template.worker.results import (
        RESULTS_FILE,
        WEIGHTS_FILE,
        collect_results,
        export_weights,
        write_json_atomic,
    )
    from ddp_template.worker.sharding import bare_state_dict
    from ddp_template.worker.trackers import attach_results

    _quiet_known_warnings()
    _configure_console_logging()
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule, module = build_task(cfg)
    compile_if_asked(cfg, module)
    trainer = build_trainer(cfg)
    ckpt_path = resume_point(cfg)
    with explain_unused_parameters(module):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    # trainer.test replaces callback_metrics: keep what fit measured (throughput, memory).
    fit_metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}

    test_metrics: dict[str, float] = {}
    if cfg.test:
        best = trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path
        (test_metrics,) = trainer.test(
            module, datamodule=datamodule, ckpt_path="best" if best else None, verbose=False
        )

    # Every rank: a sharded network is gathered onto rank 0.
    bare_weights = bare_state_dict(module.model)
    # Gloo's worker threads outlive a process group left to the interpreter's exit, which
    # then aborts ("terminate called without an active exception", pytorch#190489): the
    # last collective is done, so every rank leaves the group here.
    leave_process_group()
    if not trainer.is_global_zero:
        return None
    job_dir = Path(cfg.paths.output_dir)
    weights = job_dir / WEIGHTS_FILE
    export_weights(bare_weights, weights)
    results = collect_results(
        cfg, trainer, fit_metrics, test_metrics, weights, attempts_summary(trainer)
    )
    results["restarts"] = restart_count()
    results["requeues"] = requeue_count()
    results["resumed_from"] = ckpt_path
    results["nodes"] = nodes_of_job()
    monitors = [c for c in trainer.callbacks if isinstance(c, DDPSettingsMonitor)]
    results["gradients"] = monitors[0].gradients if monitors else None
    write_json_atomic(job_dir / RESULTS_FILE, results)
    attach_results(trainer.loggers, job_dir / RESULTS_FILE, results)
    return results


@contextlib.contextmanager
def _cpu_threads(local_processes: int) -> Iterator[None]:
    """One rank per core group: without this, N ranks each start a thread per core. The
    count goes into OMP_NUM_THREADS for the run (Lightning's DDP set-up would otherwise set
    its own from the affinity mask alone, above a cgroup's cpu quota:
    `_set_num_threads_if_needed`), and out again after it, so that a later run in this
    process, or a process it starts, computes its own. A value the user exported wins."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    import torch

    from ddp_template.launch.topology import cores_per_process

    threads = cores_per_process(local_processes)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def _configure_console_logging() -> None:
    """Lightning adds a console handler of its own, on stderr. Where Hydra set up logging
    (in-process runs) it would print every message twice: Hydra's handlers take over (and
    also write train.log). In a worker of the elastic agent it moves to stdout, the stream
    that reaches the console for rank 0."""
    import logging

    # An advertisement Lightning prints at every start.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "litlogger" not in record.getMessage()
    )
    # Imported before Hydra set up logging (the config checks build Lightning objects),
    # lightning.pytorch and lightning.fabric gave themselves a stderr handler and stopped
    # propagating: both are undone, so that their messages go where "lightning"'s do.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    lightning_logger = logging.getLogger("lightning")
    if logging.getLogger().handlers:
        lightning_logger.handlers.clear()
        lightning_logger.propagate = True
        return
    lightning_logger.handlers = [logging.StreamHandler(sys.stdout)]
    lightning_logger.propagate = False


def _quiet_known_warnings() -> None:
    # SpeedMonitor logs values it already reduced over ranks.
    warnings.filterwarnings("ignore", ".*self.log\\('(perf|ddp)/.*sync_dist=True.*")
    # Raised inside Lightning by newer torch releases; nothing a user can act on.
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")
