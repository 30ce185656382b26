"""Benchmark mode, the recipes sweep, its report and notebook, and a communication hook in a
real 2-process run. Tiny images and a few steps: the figures are not the point here, that
they are measured, recorded and compared is."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.runs import ROOT, results, train

TINY_BENCHMARK = [
    "experiment=benchmark",
    "data.image_size=8",
    "data.batch_size=16",
    "benchmark.warmup_steps=1",
    "benchmark.steps=3",
]
RECIPES = ["baseline", "amp", "data", "comm", "shard"]
# 16-mixed needs CUDA: on the CPU (train() pins it) Lightning runs bf16-mixed.
MIXED = "bf16-mixed"


def report(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.report", str(folder), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def csv_rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "report.csv").open() as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def recipe_sweep(tmp_path_factory) -> Path:
    """The article's table, tiny: one multirun over the four recipes on one device."""
    tmp = tmp_path_factory.mktemp("recipes")
    sweep = tmp / "sweep"
    train("-m", *TINY_BENCHMARK, "recipe=" + ",".join(RECIPES), f"hydra.sweep.dir={sweep}", cwd=tmp)
    return sweep


@pytest.mark.slow
def test_each_recipe_records_the_benchmark_figures(recipe_sweep: Path) -> None:
    runs = {name: results(recipe_sweep / str(job)) for job, name in enumerate(RECIPES)}
    for name, out in runs.items():
        assert out["measured_steps"] == 3, name
        assert out["global_step"] == 4 and "test/acc" not in out
        assert out["samples_per_sec"] > 0
        assert out["samples_per_sec_per_device"] == out["samples_per_sec"]
        assert 0 < out["step_time_median_s"] <= out["step_time_p90_s"]
        assert 0 <= out["data_wait_fraction"] < 1
        # Counted once on a meta copy; the rate follows from it; no MFU on the CPU.
        assert out["flops_per_sample"] > 0
        assert out["tflops_per_sec"] == pytest.approx(
            out["samples_per_sec"] * out["flops_per_sample"] / 1e12
        )
        assert out["tflops_per_sec_per_device"] == pytest.approx(out["tflops_per_sec"])
        assert out["mfu"] is None
        assert out["peak_memory_mb_over_ranks"]["max_rank"] == 0
        assert out["checkpoints"] == {"best": None, "last": None}
    assert runs["baseline"]["precision_used"] == "32-true"
    for name in ("amp", "data", "comm"):
        assert runs[name]["precision_requested"] == "16-mixed"
        assert runs[name]["precision_used"] == MIXED
    # shard: data's loading, sharded (FSDP's own mixed precision: bf16-mixed).
    assert runs["shard"]["strategy"] == "fsdp" and runs["shard"]["precision_used"] == MIXED
    assert runs["shard"]["config"]["data"]["num_workers"] >= 1
    assert runs["amp"]["config"]["data"]["num_workers"] == 0
    assert runs["data"]["config"]["data"]["num_workers"] >= 1
    baseline_ddp, comm_ddp = runs["baseline"]["ddp"], runs["comm"]["ddp"]
    assert baseline_ddp["comm_hook"] == "none" and baseline_ddp["comm_hook_calls"] == 0
    # Read back from the live DDP model: the fp16 hook ran, at least once per step.
    assert comm_ddp["comm_hook"] == "fp16" and comm_ddp["comm_hook_calls"] >= 4
    assert comm_ddp["bucket_cap_mb"] == 50.0 and comm_ddp["static_graph"] is True


@pytest.mark.slow
def test_report_compares_the_recipes(recipe_sweep: Path) -> None:
    proc = report(recipe_sweep)
    assert proc.returncode == 0, proc.stderr
    rows = csv_rows(recipe_sweep)
    assert [row["setting"] for row in rows] == [f"recipe={name}" for name in RECIPES]
    measured = [results(recipe_sweep / str(job)) for job in range(len(RECIPES))]
    base = measured[0]
    for row, out in zip(rows, measured, strict=True):
        assert float(row["samples_per_sec"]) == pytest.approx(out["samples_per_sec"])
        assert float(row["speedup"]) == pytest.approx(
            out["samples_per_sec"] / base["samples_per_sec"]
        )
        assert float(row["memory_change"]) == pytest.approx(
            out["peak_memory_mb"] / base["peak_memory_mb"] - 1
        )
        assert row["precision_used"] == out["precision_used"]
        assert float(row["tflops_per_sec_per_device"]) == pytest.approx(
            out["tflops_per_sec_per_device"]
        )
        assert row["mfu"] == ""
        assert row["strategy"] == out["strategy"]
        held = sum(part["max"] for part in out["model_state_mb_over_ranks"].values())
        assert float(row["model_state_mb"]) == pytest.approx(held) and held > 0
        assert f"| {row['setting']} |" in proc.stdout or f"**{row['setting']}**" in proc.stdout
    assert "| setting | samples/s | per device | TFLOP/s per device | MFU |" in proc.stdout
    assert "| model state (MiB per rank) |" in proc.stdout
    assert [row["strategy"] for row in rows] == ["ddp"] * 4 + ["fsdp"]
    assert (recipe_sweep / "report.md").read_text().count("\n| ") == len(RECIPES) + 1
    assert (recipe_sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_names_the_jobs_that_left_no_results(recipe_sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "sweep"
    shutil.copytree(recipe_sweep, copy)
    (copy / "2" / "results.json").unlink()
    proc = report(copy)
    assert proc.returncode == 0, proc.stderr
    assert [row["setting"] for row in csv_rows(copy)] == [
        "recipe=baseline",
        "recipe=amp",
        "recipe=comm",
        "recipe=shard",
    ]
    assert "Not measured (no results.json): recipe=data" in proc.stdout


def test_report_on_a_folder_without_results_fails_clearly(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    foreign = tmp_path / "foreign"
    (foreign / "0").mkdir(parents=True)
    (foreign / "0" / "results.json").write_text(json.dumps({"accuracy": 0.9}))
    (foreign / "notes.txt").write_text("not a sweep")
    for folder in (empty, foreign, tmp_path / "missing"):
        proc = report(folder)
        assert proc.returncode == 2, proc.stdout
        assert proc.stderr.startswith("error: ") and str(folder) in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1  # one paragraph, no traceback
        assert not (folder / "report.md").exists()


@pytest.mark.slow
def test_report_of_a_bucket_size_sweep_repeated_over_seeds(tmp_path: Path) -> None:
    sweep = tmp_path / "buckets"
    train(
        "-m",
        *TINY_BENCHMARK,
        "recipe=baseline",
        "seed=1,2",
        "strategy.bucket_cap_mb=1,4",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert report(sweep).returncode == 0
    jobs = csv_rows(sweep)
    assert [row["setting"] for row in jobs] == [
        f"seed={seed} strategy.bucket_cap_mb={size}" for seed in (1, 2) for size in (1, 4)
    ]
    # Bucket sizes read back from the live DDP model, not from the config.
    assert [float(row["bucket_cap_mb"]) for row in jobs] == [1.0, 4.0, 1.0, 4.0]

    proc = report(sweep, "--median-over", "seed")
    assert proc.returncode == 0, proc.stderr
    rows = csv_rows(sweep)
    assert [row["setting"] for row in rows] == [
        "strategy.bucket_cap_mb=1",
        "strategy.bucket_cap_mb=4",
    ]
    for row, size in zip(rows, (1, 4), strict=True):
        same = [float(j["samples_per_sec"]) for j in jobs if j["bucket_cap_mb"] == f"{size}.0"]
        assert float(row["samples_per_sec"]) == pytest.approx(sum(same) / 2)
        assert row["repeats"] == "2"
    assert float(rows[0]["speedup"]) == 1.0
    assert "medians of 2 jobs that differ only in seed" in proc.stdout


@pytest.mark.slow
def test_notebook_plots_a_sweep(recipe_sweep: Path, monkeypatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("SWEEP_DIR", str(recipe_sweep))
    notebook = nbformat.read(ROOT / "notebooks" / "compare_recipes.ipynb", as_version=4)
    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    )
    client.execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert any("image/png" in out.get("data", {}) for out in outputs)
    printed = "".join(out.get("text", "") for out in outputs)
    assert "recipe=comm" in printed and str(recipe_sweep) in printed


@pytest.mark.slow
def test_comm_hook_runs_in_a_two_process_run(tmp_path: Path) -> None:
    """PowerSGD on gloo with several gradient buckets (which can deadlock gloo's worker
    threads unless buckets go one at a time), channels-last weights: the hook is called for
    every bucket of every step."""
    run_dir = tmp_path / "run"
    train(
        *TINY_BENCHMARK,
        "recipe=comm",
        "devices=2",
        "strategy.comm_hook=powersgd",
        "strategy.bucket_cap_mb=5",
        "task.module.model.channels_last=true",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["world_size"] == 2
    # ResNet-18's 45 MB of gradients in 5 MiB buckets: more than one bucket per step.
    assert out["ddp"]["comm_hook"] == "powersgd" and out["ddp"]["comm_hook_calls"] >= 2 * 4
    assert out["peak_memory_mb_over_ranks"]["max_rank"] in (0, 1)
    assert out["data_wait_fraction_over_ranks"]["max"] == out["data_wait_fraction"]
    assert out["samples_per_sec_per_device"] == pytest.approx(out["samples_per_sec"] / 2)
    # Each rank's CPU per step (its threads: the backward, PowerSGD, gloo's copies), positive
    # and spread over both ranks.
    cpu = out["cpu_s_per_step_over_ranks"]
    assert 0 < cpu["min"] <= cpu["median"] <= cpu["max"]
    assert {cpu["min_rank"], cpu["max_rank"]} <= {0, 1}


@pytest.mark.slow
def test_exposed_communication_is_measured_under_ddp_and_fsdp(
    recipe_sweep: Path, tmp_path: Path
) -> None:
    """Two ranks of `ddp` and of `fsdp` side by side in the report: what communication
    added to a step, measured for both (DDP's timers; the training thread's wait in FSDP's
    collectives, which on CPUs block it), positive and less than the step; one process
    has none to measure (n/a, not 0)."""
    sweep = tmp_path / "sweep"
    train(
        "-m",
        *TINY_BENCHMARK,
        "devices=2",
        "strategy=ddp,fsdp",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    proc = report(sweep)
    assert proc.returncode == 0, proc.stderr
    rows = {row["setting"]: row for row in csv_rows(sweep)}
    assert set(rows) == {"strategy=ddp", "strategy=fsdp"}
    for name, row in rows.items():
        out = results(Path(row["job_dir"]))
        exposed = out["exposed_comm_s"]
        assert exposed is not None and 0 < exposed < out["step_time_median_s"], name
        assert float(row["exposed_comm_s"]) == pytest.approx(exposed)
        assert out["exposed_comm_s_over_ranks"]["max"] >= exposed
    assert "| exposed comm (ms) |" in proc.stdout
    one_process = results(recipe_sweep / "0")
    assert one_process["world_size"] == 1 and one_process["exposed_comm_s"] is None


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A script of benchmarks/ in its report or refusal paths (no lab, no training)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("period", ["999", "1000001"])
def test_the_validations_quota_period_out_of_range_is_refused_before_anything_runs(
    period: str, tmp_path: Path
) -> None:
    """`scaling_validation.py --cfs-period-us`: cgroup v1 takes 1000 to 1000000 us; outside
    that the script stops in one paragraph before it makes a cgroup, a lab or a run."""
    out = tmp_path / "out"
    proc = run_script(
        "scaling_validation.py", "--nodes", "2", "--cfs-period-us", period, "--out", str(out)
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--cfs-period-us={period} is not valid: cgroup v1 takes 1000 to 1000000" in proc.stderr
    assert not out.exists()


def test_the_validation_refuses_a_period_too_short_for_a_nodes_quota(tmp_path: Path) -> None:
    """8 nodes of 0.2 core at a 4 ms period would be a quota of 800 us, which cgroup v1
    refuses: the script says so in one paragraph before it makes anything (before: the
    kernel's EINVAL from a cgroup file, after the 2-node runs)."""
    out = tmp_path / "out"
    proc = run_script(
        "scaling_validation.py", "--nodes", "2,8", "--cfs-period-us", "4000", "--out", str(out)
    )
    assert proc.returncode == 2, proc.stderr
    assert "--cfs-period-us=4000 is not valid for 8 nodes: each gets 0.2 of a core" in proc.stderr
    assert "Fix: --cfs-period-us 5000 or more" in proc.stderr
    assert not out.exists()


def test_the_validation_refuses_another_quota_period_into_a_folder_measured_with_one(
    tmp_path: Path,
) -> None:
    """A run into an --out it measured before keeps the runs there: at another quota period
    they would be reported as if measured alike, so it stops before measuring anything."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "cfs_period_us.txt").write_text("10000")
    proc = run_script("scaling_validation.py", "--nodes", "2", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "--cfs-period-us=100000 is not valid for --out" in proc.stderr
    assert "measured with 10000 us" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["cfs_period_us.txt"]


def test_the_validation_report_takes_the_median_of_repeated_runs(tmp_path: Path) -> None:
    """`scaling_validation.py --repeats 3 --report-only`: each setting's measured step is the
    median of its runs (one slow run of three moves nothing), the spread is shown, and the
    recommendation is judged against those medians."""
    out = tmp_path / "out"
    out.mkdir()
    lines = [
        f"nodes=2 hook={hook} bucket_cap_mb={bucket} compute 0.500 s exposed comm 0.100 s "
        f"data wait 0.001 s {floor}predicted step time: {step:.3f} s"
        for hook, bucket, step, floor in (
            ("none", 1, 2.0, ""),
            ("none", 25, 2.1, ""),
            ("none", 100, 2.2, ""),
            ("fp16", 25, 1.5, ""),
            # The floor's parts as the command prints them: the rank CPU it assumed.
            ("powersgd", 25, 1.0, "CPU floor 1.000 s (a rank's CPU 0.680 s a step) "),
        )
    ]
    lines += [
        "measured: step 0.520 s (forward 0.200, backward 0.300, rest 0.010, data wait 0.010), "
        "42.6 MiB of gradients, 1 device(s) per node; link: float32 200mbit",
        "hook compute per step (probe): none 0 ms, fp16 10 ms, powersgd 60 ms",
        "recommended at nodes=2: strategy.comm_hook=powersgd strategy.bucket_cap_mb=25 (...)",
    ]
    (out / "predicted_2_200mbit.txt").write_text("\n".join(lines) + "\n")
    runs = {"none_1": [2.0], "powersgd_25": [1.0, 1.9, 1.1], "fp16_25": [1.2, 1.25]}
    for name, steps in runs.items():
        for index, step in enumerate(steps):
            folder = out / "2nodes_200mbit" / (name + (f"_r{index + 1}" if index else ""))
            folder.mkdir(parents=True)
            record = {"world_size": 2, "step_time_median_s": step, "exposed_comm_s": 0.1}
            if name == "powersgd_25":  # the lab's forward: 0.2, 0.3, 0.21 s, median 0.21
                forward = {1.0: 0.2, 1.9: 0.3, 1.1: 0.21}[step]
                record["gradients"] = {"forward_compute_s": forward, "backward_compute_s": 0.3}
                # A rank's CPU per step, median over its runs 0.85 s.
                cpu = {1.0: 0.8, 1.9: 1.5, 1.1: 0.85}[step]
                record["cpu_s_per_step_over_ranks"] = {"median": cpu}
            if name == "fp16_25":  # 0.5 s of CPU: a floor of 0.625 s, under its prediction
                record["cpu_s_per_step_over_ranks"] = {"median": 0.5}
            (folder / "results.json").write_text(json.dumps(record))
    # The one-node run the command was fed: 0.4 s of CPU in a 0.52 s step at 0.8 of a core.
    (out / "one_node_0.8").mkdir()
    (out / "one_node_0.8" / "results.json").write_text(
        json.dumps({"step_time_median_s": 0.52, "cpu_s_per_step_over_ranks": {"median": 0.4}})
    )
    proc = run_script(
        "scaling_validation.py",
        *("--nodes", "2", "--rates", "200mbit", "--repeats", "3"),
        *("--out", str(out), "--report-only"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 2 x 0.8 | 200mbit | powersgd | 25 | 3 (90%) | 1.100 | 1.000 | -9.1% |" in proc.stdout
    assert "| 2 x 0.8 | 200mbit | fp16 | 25 | 2 (4%) | 1.225 | 1.500 | +22.4% |" in proc.stdout
    assert "| 2 x 0.8 | 200mbit | none | 1 | 1 (0%) | 2.000 | 2.000 | +0.0% |" in proc.stdout
    # Its forward beside the one-node run's (0.21 against 0.2), where the runs recorded it.
    assert "| 0.100 | +5% |" in proc.stdout and "| 0.100 | n/a |" in proc.stdout
    # The rank's CPU per step against the one-node run's (0.85 against 0.4) and the share of
    # the node's quota it used (0.85 s of 1.1 s x 0.8 core).
    assert "| +5% | 0.850 (+112%) | 97% |" in proc.stdout
    assert "| n/a | n/a (n/a) | n/a |" in proc.stdout
    # 1.0 s predicted, under the 0.85 s / 0.8 core = 1.06 s its rank's CPU allows.
    assert (
        "1 of 2 predictions lie below their job's CPU floor (a rank's CPU per step over its "
        "quota): their errors -9.1% to -9.1%; the other 1: mean error +22.4%."
    ) in proc.stdout
    # The lane measured in the job: PowerSGD's 0.85 s of CPU over 0.8 of a core plus 0.1 s
    # exposed, 1.1625 s, against its 1.1 s step (+5.7%) and its 1.0 s prediction (-14.0%).
    assert (
        "- 200mbit powersgd: lane vs step +5.7% (+6% to +6%), predicted vs lane -14.0%, "
        "predicted vs step -9.1% (1 jobs); the rank CPU it assumed vs the job's -20.0%"
    ) in proc.stdout
    assert "- 200mbit fp16: lane vs step -40.8%" in proc.stdout
    assert "200mbit none:" not in proc.stdout  # no CPU recorded: no lane
    assert (
        "- 2 nodes: 1 one-node run 0.520 s (spread 0%); the command was fed one_node_0.8, "
        "0.400 s of CPU a step (96% of its quota)"
    ) in proc.stdout
    assert "Of the 1 jobs whose forward ran within 10% of the one-node run's, 1 within 15%." in (
        proc.stdout
    )
    # PowerSGD's median (1.100) is the measured best: the recommendation holds.
    assert "| 2 | 200mbit | powersgd 25 (1.100) | powersgd 25 (1.100) | +0.0% |" in proc.stdout
    # Without the repeats only the first runs count: PowerSGD's 1.000.
    once = run_script(
        "scaling_validation.py",
        "--nodes",
        "2",
        "--rates",
        "200mbit",
        "--out",
        str(out),
        "--report-only",
    )
    assert "| powersgd | 25 | 1 (0%) | 1.000 | 1.000 | +0.0% |" in once.stdout


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_the_validation_refuses_fewer_than_one_run(repeats: str, tmp_path: Path) -> None:
    proc = run_script(
        "scaling_validation.py", "--nodes", "2", "--repeats", repeats, "--out", str(tmp_path / "o")
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--repeats={repeats} is not valid: at least one run" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_the_fsdp_lab_report_sets_each_strategy_beside_its_prediction_and_ddp(
    tmp_path: Path,
) -> None:
    """`fsdp_lab.py --report-only`: from the folders a measurement leaves, each strategy's
    measured step beside its prediction (DDP's from the scaling command's `none` at 25 MiB,
    FSDP's from the dry run) and beside DDP's step."""
    out = tmp_path / "out"
    (out / "dry_run_2_200mbit").mkdir(parents=True)
    (out / "predicted_2_200mbit.txt").write_text(
        "nodes=2 hook=none bucket_cap_mb=1 compute 0.5 s predicted step time: 1.800 s\n"
        "nodes=2 hook=none bucket_cap_mb=25 compute 0.5 s predicted step time: 2.200 s\n"
    )
    plan = {"prediction": {"per_hook": {"fsdp": {"step_s": 3.0}}}}
    (out / "dry_run_2_200mbit" / "dry_run.json").write_text(json.dumps(plan))
    for strategy, step in (("ddp", 2.0), ("fsdp", 4.0)):
        folder = out / "2nodes_200mbit" / strategy
        folder.mkdir(parents=True)
        record = {"world_size": 2, "step_time_median_s": step}
        (folder / "results.json").write_text(json.dumps(record))
    proc = run_script(
        "fsdp_lab.py", "--nodes", "2", "--rates", "200mbit", "--out", str(out), "--report-only"
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 2 x 0.8 | 200mbit | ddp | 2.000 | 2.200 | +10.0% | 1.00 | 1.00 |" in proc.stdout
    assert "| 2 x 0.8 | 200mbit | fsdp | 4.000 | 3.000 | -25.0% | 2.00 | 1.36 |" in proc.stdout
    assert (out / "fsdp_lab.md").read_text().strip() == proc.stdout.strip()


def test_the_validation_feeds_the_command_the_median_one_node_run(tmp_path: Path) -> None:
    """With --repeats each pass has its own one-node run: the command is fed the one whose
    step is the median (one slow or fast reference moves every prediction of its node
    count), and the report lists them; a lab with quotas places the runs as it places its
    nodes (every core), a pinned lab pins them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling_validation as sv

    for name, step in (("one_node_0.2", 2.5), ("one_node_0.2_r2", 2.0), ("one_node_0.2_r3", 2.9)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"step_time_median_s": step}))
    assert sv.median_reference(tmp_path, 0.2, 3).name == "one_node_0.2"
    # Two runs: the lower middle one; one run: itself.
    assert sv.median_reference(tmp_path, 0.2, 2).name == "one_node_0.2_r2"
    assert sv.median_reference(tmp_path, 0.2, 1).name == "one_node_0.2"
    args = SimpleNamespace(out=tmp_path, node_counts=[8], total_cores=1.6, repeats=3, feed="median")
    assert sv.reference_lines(args) == [
        "- 8 nodes: 3 one-node runs 2.500, 2.000, 2.900 s (spread 45%); the command was fed "
        "one_node_0.2"
    ]
    # The neighbours' runs of a pass (the same steps beside node 0's, each in its own quota)
    # are one-node runs too: the median of all of them is fed.
    for index, step in ((1, 2.7), (2, 2.6)):
        neighbour = tmp_path / "one_node_0.2_r2" / "neighbours" / str(index)
        neighbour.mkdir(parents=True)
        (neighbour / "results.json").write_text(json.dumps({"step_time_median_s": step}))
    fed = sv.median_reference(tmp_path, 0.2, 3)
    assert fed == tmp_path / "one_node_0.2_r2" / "neighbours" / "2"
    assert sv.reference_lines(args) == [
        "- 8 nodes: 5 one-node runs 2.000 to 2.900 s, median 2.600 s (spread 45%); the "
        "command was fed one_node_0.2_r2/neighbours/2"
    ]
    with pytest.raises(RuntimeError, match="no one-node run"):
        sv.median_reference(tmp_path, 0.4, 3)
    assert sv.placement(SimpleNamespace(link_from="lab"), 3) == []
    assert sv.placement(SimpleNamespace(link_from="rate"), 3)[:2] == ["taskset", "-c"]


def test_the_validation_reports_each_pass_and_the_machines_speed_then(tmp_path: Path) -> None:
    """With --repeats the report sets the predictions against each pass's runs alone, and the
    machine's speed read beside that pass's jobs against its speed beside the fed one-node
    run: a drifting machine is told apart from the model. The reading itself is real work."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling_validation as sv

    assert sv.machine_speed() > 0
    sv.record_speed(tmp_path / "probe")
    assert sv.read_speed(tmp_path / "probe") > 0
    assert sv.read_speed(tmp_path / "nothing") is None
    # Two passes: the fed run is a neighbour of the first (its pass's reading is node 0's).
    for name, step, speed in (("one_node_0.8", 1.0, 100.0), ("one_node_0.8_r2", 1.3, 80.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"step_time_median_s": step}))
        (tmp_path / name / sv.SPEED_FILE).write_text(json.dumps({"rounds_per_cpu_s": speed}))
    neighbour = tmp_path / "one_node_0.8" / "neighbours" / "1"
    neighbour.mkdir(parents=True)
    (neighbour / "results.json").write_text(json.dumps({"step_time_median_s": 1.1}))
    assert sv.median_reference(tmp_path, 0.8, 2) == neighbour
    assert sv.pass_folder(neighbour) == tmp_path / "one_node_0.8"
    rows = [
        {
            "nodes": 2,
            "rate": "1gbit",
            "comm_hook": hook,
            "bucket_cap_mb": 25,
            "predicted_step_s": 2.0,
        }
        for hook in ("none", "fp16")
    ]
    # Pass 1 at the fed run's speed, within 15%; pass 2 on a machine 25% slower, 30% slower.
    for (hook, repeat), (step, speed) in {
        ("none", 0): (2.1, 100.0),
        ("fp16", 0): (1.9, 98.0),
        ("none", 1): (2.9, 75.0),
        ("fp16", 1): (2.8, 75.0),
    }.items():
        folder = sv.job_folder(tmp_path, 2, "1gbit", hook, 25, repeat)
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"step_time_median_s": step}))
        (folder / sv.SPEED_FILE).write_text(json.dumps({"rounds_per_cpu_s": speed}))
    args = SimpleNamespace(out=tmp_path, node_counts=[2], total_cores=1.6, repeats=2, feed="median")
    assert sv.pass_lines(args, rows, []) == [
        "- 2 nodes, pass 1 alone: 2 of 2 within 15% (mean +0.3%); the machine at -1% of its "
        "speed when the fed one-node run ran (median of the jobs' readings).",
        "- 2 nodes, pass 2 alone: 0 of 2 within 15% (mean -29.8%); the machine at -25% of its "
        "speed when the fed one-node run ran (median of the jobs' readings).",
    ]
    # One pass: nothing to set apart.
    assert sv.pass_lines(SimpleNamespace(**{**vars(args), "repeats": 1}), rows, []) == []


def command_output(predicted: dict[str, float], fed_step: float, powersgd_ms: int) -> str:
    """What `python -m ddp_template.tools.scaling` prints for 2 nodes at 200 Mbit/s: a
    prediction for `none` at 1 MiB and PowerSGD at 25 MiB (`predicted`, by hook), the fed
    run's step, the hook probe and a recommendation of PowerSGD."""
    lines = [
        f"nodes=2 hook={hook} bucket_cap_mb={bucket} compute 0.500 s exposed comm 0.100 s "
        f"data wait 0.001 s predicted step time: {predicted[hook]:.3f} s"
        for hook, bucket in (("none", 1), ("powersgd", 25))
    ]
    lines += [
        f"measured: step {fed_step:.3f} s (forward 0.200, backward 0.300, rest 0.010, data wait "
        "0.010), 42.6 MiB of gradients, 1 device(s) per node; link: float32 200mbit",
        f"hook compute per step (probe): none 0 ms, powersgd {powersgd_ms} ms",
        "recommended at nodes=2: strategy.comm_hook=powersgd strategy.bucket_cap_mb=25 (...)",
    ]
    return "\n".join(lines) + "\n"


def test_the_validation_feeds_each_pass_its_own_one_node_run(tmp_path: Path) -> None:
    """`--feed each`: every pass and rate is a block (its one-node runs, that rate's jobs,
    the command fed the block's median run); each prediction is set against its own block's
    job, never another pass's, and the report says how far the machine's speed beside each
    job was from its speed beside the fed run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling_validation as sv

    out = tmp_path / "out"
    # Pass 2's one-node run is 30% slower (the machine slowed): its predictions are too.
    for repeat, (step, speed, predicted) in enumerate(
        [(1.0, 100.0, {"none": 2.0, "powersgd": 1.0}), (1.3, 80.0, {"none": 2.6, "powersgd": 1.3})]
    ):
        block = sv.block_folder(out, 0.8, "200mbit", repeat)
        block.mkdir(parents=True)
        (block / "results.json").write_text(json.dumps({"step_time_median_s": step}))
        (block / sv.SPEED_FILE).write_text(json.dumps({"rounds_per_cpu_s": speed}))
        sv.predicted_file(out, 2, "200mbit", repeat).write_text(
            command_output(predicted, step, 60 * (repeat + 1))
        )
    for (hook, bucket, repeat), (step, speed) in {
        ("none", 1, 0): (2.1, 98.0),
        ("powersgd", 25, 0): (1.05, 100.0),
        ("none", 1, 1): (2.5, 80.0),
        ("powersgd", 25, 1): (2.8, 72.0),
    }.items():
        folder = sv.job_folder(out, 2, "200mbit", hook, bucket, repeat)
        folder.mkdir(parents=True)
        record = {"world_size": 2, "step_time_median_s": step}
        (folder / "results.json").write_text(json.dumps(record))
        (folder / sv.SPEED_FILE).write_text(json.dumps({"rounds_per_cpu_s": speed}))
    proc = run_script(
        "scaling_validation.py",
        *("--nodes", "2", "--rates", "200mbit", "--repeats", "2", "--feed", "each"),
        *("--out", str(out), "--report-only"),
    )
    assert proc.returncode == 0, proc.stderr
    # Each pass against its own prediction: 2.0 against 2.1, 2.6 against 2.5 (not 2.1).
    assert "| 2 x 0.8 | 200mbit | none | 1 | pass 1 | 2.100 | 2.000 | -4.8% |" in proc.stdout
    assert "| 2 x 0.8 | 200mbit | none | 1 | pass 2 | 2.500 | 2.600 | +4.0% |" in proc.stdout
    assert "| 2 x 0.8 | 200mbit | powersgd | 25 | pass 2 | 2.800 | 1.300 | -53.6% |" in (
        proc.stdout
    )
    # Each pass's recommendation against that pass's best.
    assert "| 2 (pass 1) | 200mbit | powersgd 25 (1.050) | powersgd 25 (1.050) | +0.0% |" in (
        proc.stdout
    )
    assert "| 2 (pass 2) | 200mbit | powersgd 25 (2.800) | none 1 (2.500) | +12.0% |" in (
        proc.stdout
    )
    assert "3 of 4 predictions within 15%" in proc.stdout
    assert (
        "- 2 nodes, pass 1: 2 of 2 within 15% (mean -4.8%); the machine at -2% to +0% of its "
        "speed beside the fed one-node run."
    ) in proc.stdout
    assert (
        "- 2 nodes, pass 2: 1 of 2 within 15% (mean -24.8%); the machine at -10% to +0% of "
        "its speed beside the fed one-node run."
    ) in proc.stdout
    assert "- 2 nodes (pass 2): hook compute per step (probe): none 0 ms, powersgd 120 ms" in (
        proc.stdout
    )
    assert (
        "- 2 nodes, 200mbit, pass 2: 1 one-node run 1.300 s (spread 0%); the command was fed "
        "one_node_0.8_200mbit_r2"
    ) in proc.stdout
    # Over the passes: none 1's errors -4.8% and +4.0% (median -0.4%), powersgd 25's -4.8%
    # and -53.6% (median -29.2%); the median steps 2.300 and 1.925 s: powersgd the best.
    assert "| 2 | 200mbit | none | 1 | 2.100, 2.500 | 2.000, 2.600 | -4.8%, +4.0% | -0.4% |" in (
        proc.stdout
    )
    assert (
        "Each setting's median error over its passes: 1 of 2 within 15% (largest 29.2%; 2 "
        "negative, mean -14.8%)."
    ) in proc.stdout
    assert (
        "Against the settings' median steps over the passes, each pass's recommendation is "
        "the best or within 5% of it in 2 of 2 cases (at most +0.0%)."
    ) in proc.stdout
    rows = list(csv.DictReader((out / "scaling_validation.csv").open()))
    assert [(r["pass"], r["machine_vs_fed"]) for r in rows] == [
        ("1", "-0.02"),
        ("1", "0.0"),
        ("2", "0.0"),
        ("2", "-0.1"),
    ]


def test_the_validation_feeds_each_job_its_own_one_node_run(monkeypatch, tmp_path: Path) -> None:
    """`--feed job`: each job's own one-node runs come right before it and the command fed
    them right after it (the lab probed once a pass and rate, each command given that
    file); the report sets each job against its own command's prediction and names the run
    each command was fed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling_validation as sv

    out = tmp_path / "out"
    order: list[tuple] = []
    monkeypatch.setattr(
        sv, "save_lab_probe", lambda args, probe: order.append(("probe", probe.name))
    )
    monkeypatch.setattr(
        sv,
        "one_node_run",
        lambda args, fraction, nodes, repeat, command, folder: order.append(
            ("one node", folder.name)
        ),
    )
    monkeypatch.setattr(
        sv,
        "run_job",
        lambda args, lab, nodes, rate, hook, bucket, repeat, port: order.append(
            ("job", hook, bucket)
        ),
    )
    monkeypatch.setattr(sv, "runs_in", lambda folder: [(1.0, folder)])
    monkeypatch.setattr(
        sv,
        "command_after_jobs",
        lambda args, reference, nodes, rate, repeat, setting, link: order.append(
            ("command", reference.name, setting, link)
        ),
    )
    lab = SimpleNamespace(set_rate=lambda bps: order.append(("rate", bps)))
    args = SimpleNamespace(
        current=0.8,
        out=out,
        repeats=1,
        rate_list=["200mbit"],
        full=False,
        link_from="lab",
        feed="job",
    )
    sv.measure_each_pass(args, lab, 2, 29500)
    probe = ["--link", str(sv.probe_file(out, 2, "200mbit", 0))]
    assert order[:6] == [
        ("rate", 200_000_000),
        ("probe", "probe_2_200mbit_r1.json"),
        ("one node", "one_node_0.8_200mbit_r1_none_1"),
        ("job", "none", 1),
        ("command", "one_node_0.8_200mbit_r1_none_1", ("none", 1), probe),
        ("one node", "one_node_0.8_200mbit_r1_none_25"),
    ]
    # Every job of the reduced grid, each between its own one-node run and its command.
    assert [e for e in order if e[0] == "job"] == [("job", h, b) for h, b in sv.grid(False)]
    assert sum(e[0] == "probe" for e in order) == 1

    # The report: each job against the command fed its own one-node run.
    for (hook, bucket), (fed_step, predicted, measured) in {
        ("none", 1): (1.0, 2.0, 2.1),
        ("powersgd", 25): (1.3, 1.3, 1.25),
    }.items():
        folder = sv.block_folder(out, 0.8, "200mbit", 0, (hook, bucket))
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"step_time_median_s": fed_step}))
        # Both commands print both settings; only the job's own line counts for it.
        steps = {h: predicted if h == hook else 9.0 for h in ("none", "powersgd")}
        sv.predicted_file(out, 2, "200mbit", 0, (hook, bucket)).write_text(
            command_output(steps, fed_step, 60)
        )
        job = sv.job_folder(out, 2, "200mbit", hook, bucket, 0)
        job.mkdir(parents=True)
        (job / "results.json").write_text(
            json.dumps({"world_size": 2, "step_time_median_s": measured})
        )
    proc = run_script(
        "scaling_validation.py",
        *("--nodes", "2", "--rates", "200mbit", "--repeats", "1", "--feed", "job"),
        *("--out", str(out), "--report-only"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "| 2 x 0.8 | 200mbit | none | 1 | pass 1 | 2.100 | 2.000 | -4.8% |" in proc.stdout
    assert "| 2 x 0.8 | 200mbit | powersgd | 25 | pass 1 | 1.250 | 1.300 | +4.0% |" in proc.stdout
    assert "| 2 (pass 1) | 200mbit | powersgd 25 (1.250) | powersgd 25 (1.250) | +0.0% |" in (
        proc.stdout
    )
    assert (
        "- 2 nodes, 200mbit, pass 1, powersgd 25: 1 one-node run 1.300 s (spread 0%); the "
        "command was fed one_node_0.8_200mbit_r1_powersgd_25"
    ) in proc.stdout


def test_the_validation_report_of_a_folder_without_its_predictions_says_so(tmp_path: Path) -> None:
    """`--report-only` where nothing was measured with those --nodes/--rates/--feed (here a
    grid measured with --feed each, reported with the default): one paragraph, exit 2, no
    report written."""
    out = tmp_path / "out"
    (out / "2nodes_200mbit" / "none_1").mkdir(parents=True)
    (out / "predicted_2_200mbit_r1.txt").write_text("measured with --feed each\n")
    proc = run_script(
        "scaling_validation.py",
        "--nodes",
        "2",
        "--rates",
        "200mbit",
        "--out",
        str(out),
        "--report-only",
    )
    assert proc.returncode == 2
    assert "holds no lab job beside a prediction" in proc.stderr
    assert "--feed median" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "scaling_validation.md").exists()
