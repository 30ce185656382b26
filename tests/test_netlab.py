"""Several nodes for real: jobs over the lab's network namespaces (`ddp_template.tools.netlab`),
each node with its own hostname, address, hosts file and core, joined by a shaped link,
one torchrun agent per node, as users start them. Nothing talks over 127.0.0.1 between
nodes here; the lab is made by the test and removed after it. Skipped, with the reason,
only where the machine cannot make network namespaces (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import FAST, ROOT, results, subprocess_env

from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.tools.netlab import DEFAULT_MTU, Lab, parse_rate, require_namespaces

# One SLURM and one lab at a time: under pytest-xdist (README's test command) the tests of
# this group run in one worker, one after another (their clusters share names, addresses
# and the one-machine SLURM's CPUs).
pytestmark = pytest.mark.xdist_group("cluster")

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TRAIN = str(ROOT / "train.py")
# What makes a node's output name our code: a traceback line inside the project.
OUR_TRACEBACK = 'File "' + str(ROOT / "src" / "ddp_template")


def _lab_or_skip(own_hostname: str, tag: str) -> Lab:
    try:
        require_namespaces()
    except UserFacingError as why:
        pytest.skip(str(why))
    return Lab.up(2, "1gbit", prefix=f"t{tag}{os.getpid() % 100000}", own_hostname=own_hostname)


@pytest.fixture(scope="module")
def lab():
    made = _lab_or_skip("link", "l")
    yield made
    made.down()


def torchrun_on_nodes(
    lab: Lab,
    cwd: Path,
    endpoint: str,
    per_node: tuple[list[str], list[str]] = ([], []),
    torchrun_args: tuple[str, ...] = (),
    private_disk: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> list[tuple[int, str, str, float]]:
    """One torchrun agent per lab node (c10d rendezvous at `endpoint`), all in `cwd`;
    returns each node's (exit code, stdout, stderr, seconds it ran)."""
    cwd.mkdir(parents=True, exist_ok=True)
    rdzv = f"job{os.getpid()}"
    started = time.monotonic()
    procs = []
    for node in (0, 1):
        command = [
            TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            f"--rdzv_id={rdzv}",
            *torchrun_args,
            TRAIN,
            "strategy=ddp",
            *FAST,
            *per_node[node],
        ]
        procs.append(
            lab.popen(
                node,
                command,
                private_disk=cwd / "outputs" if private_disk else None,
                cwd=cwd,
                env=subprocess_env(**(env or {})),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    finished = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        finished.append((proc.returncode, out, err, time.monotonic() - started))
    return finished


# --- in-process: rates and the lab's bad input ----------------------------------------


def test_link_rates_parse_like_tc() -> None:
    assert parse_rate("1gbit") == 10**9 and parse_rate("200mbit") == 200 * 10**6
    assert parse_rate("2.5gbit") == 2_500_000_000 and parse_rate("none") is None
    for bad in ("1xbit", "fast", "-1mbit", "0mbit", "1 gigabit"):
        with pytest.raises(ConfigError, match="a number and a unit of bits per second"):
            parse_rate(bad)


def test_a_rate_the_lab_cannot_parse_is_one_paragraph() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.netlab", "up", "--rate", "fast"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --rate='fast' is not valid") and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_the_lab_is_idempotent_and_reshapes_in_place(lab: Lab) -> None:
    again = Lab.up(2, "200mbit", prefix=lab.prefix)
    assert [n.address for n in again.nodes] == [n.address for n in lab.nodes]
    assert again.rate_bps == 200 * 10**6
    # tbf holds the sustained rate: a little under it, never far above it. The best of
    # several readings is the link's; single ones fall short when other work takes the
    # nodes' cores (656 Mbit/s at 1gbit with a load average of 27).
    best = max(again.probe_readings(megabytes=4, repeats=5))
    assert 0.7 * 200e6 < best < 1.1 * 200e6
    again.set_rate(10**9)
    assert 0.7 * 1e9 < max(again.probe_readings(megabytes=16, repeats=5)) < 1.1e9


def test_each_node_has_its_own_hostname_address_and_cores(lab: Lab) -> None:
    script = (
        "import json, os, socket;"
        "print(json.dumps([socket.gethostname(), socket.gethostbyname(socket.gethostname()),"
        " sorted(os.sched_getaffinity(0))]))"
    )
    seen = []
    for node in lab.nodes:
        out = subprocess.run(
            lab.command(node.index, [sys.executable, "-c", script]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        seen.append(json.loads(out))
    assert [s[0] for s in seen] == [n.hostname for n in lab.nodes]
    assert [s[1] for s in seen] == [n.address for n in lab.nodes]
    assert [tuple(s[2]) for s in seen] == [n.cores for n in lab.nodes]


def test_the_links_carry_jumbo_frames(lab: Lab) -> None:
    """Both ends of every link at the lab's MTU (9000 unless asked), as the nodes see it: at
    1500 bytes a shaped link wakes the receiver once per small packet (docs/nodes.md)."""
    assert lab.mtu == DEFAULT_MTU == 9000
    for node in lab.nodes:
        seen = subprocess.run(
            lab.command(node.index, ["cat", f"/sys/class/net/{node.interface}/mtu"]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        port = subprocess.run(
            ["ip", "-n", lab.switch, "-j", "link", "show", f"p{node.index}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert int(seen) == 9000 and json.loads(port)[0]["mtu"] == 9000
    bridge = subprocess.run(
        ["ip", "-n", lab.switch, "-j", "link", "show", "br0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # The bridge takes the smallest MTU of its ports.
    assert json.loads(bridge)[0]["mtu"] == 9000


def test_an_mtu_out_of_range_is_one_paragraph_and_builds_nothing() -> None:
    for bad in ("100", "70000"):
        proc = subprocess.run(
            [sys.executable, "-m", "ddp_template.tools.netlab", "up", "--mtu", bad]
            + ["--prefix", "tmtu"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: --mtu={bad} is not valid") and "Fix:" in proc.stderr
        assert "576 to 65535" in proc.stderr and proc.stderr.count("\n") == 1
        assert Lab.load("tmtu") is None


def test_a_quota_period_without_a_quota_is_refused_and_builds_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.netlab", "up", "--cpu-period-us", "5000"]
        + ["--prefix", "tperiod"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --cpu-period-us=5000 is not valid")
    assert "--cpu-fraction" in proc.stderr and proc.stderr.count("\n") == 1
    assert Lab.load("tperiod") is None


def test_output_cut_short_by_a_pipe_ends_without_a_traceback() -> None:
    """`netlab status | head -1`: a status longer than the pipe holds, its reader gone."""
    script = (
        "import sys\n"
        "from ddp_template.tools import netlab\n"
        "class Long:\n"
        "    def describe(self):\n"
        "        return 'node\\n' * 200000\n"
        "netlab.Lab.load = staticmethod(lambda prefix: Long())\n"
        "sys.exit(netlab.main(['status']))\n"
    )
    proc = subprocess.run(
        ["bash", "-c", 'python -c "$0" | head -1', script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**subprocess_env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    assert proc.stdout == "node\n"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


# --- jobs of two nodes over the lab ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("endpoint_by", ["hostname", "address"])
def test_two_nodes_train_over_the_lab_link(lab: Lab, tmp_path: Path, endpoint_by: str) -> None:
    host = lab.nodes[0].hostname if endpoint_by == "hostname" else lab.nodes[0].address
    ran = torchrun_on_nodes(lab, tmp_path, f"{host}:29400")
    assert [r[0] for r in ran] == [0, 0], [r[2][-3000:] for r in ran]
    written = list(tmp_path.glob("outputs/**/results.json"))
    assert len(written) == 1
    record = results(written[0].parent)
    assert record["world_size"] == 2 and record["num_nodes"] == 2
    nodes = {n["hostname"]: n for n in record["nodes"]}
    assert set(nodes) == {n.hostname for n in lab.nodes}
    for node in lab.nodes:
        assert nodes[node.hostname]["address"] == node.address
        assert nodes[node.hostname]["interface"] == "eth0"
    report = "".join(out for _, out, _, _ in ran)
    assert "network" in report and lab.nodes[1].address in report


@pytest.mark.slow
def test_own_hostname_on_loopback_still_trains(tmp_path: Path) -> None:
    """Debian's `127.0.1.1 <hostname>`: gloo would bind there and the other node would be
    told to connect to 127.0.1.1 (connectFullMesh failed). The template binds the backend
    to the interface that reaches the rendezvous host instead."""
    debian = _lab_or_skip("debian", "d")
    try:
        ran = torchrun_on_nodes(debian, tmp_path, f"{debian.nodes[0].hostname}:29400")
    finally:
        debian.down()
    assert [r[0] for r in ran] == [0, 0], [r[2][-3000:] for r in ran]
    record = results(next(tmp_path.glob("outputs/**/results.json")).parent)
    assert sorted(n["address"] for n in record["nodes"]) == sorted(n.address for n in debian.nodes)


@pytest.mark.slow
def test_nodes_started_with_different_configs_are_refused(lab: Lab, tmp_path: Path) -> None:
    ran = torchrun_on_nodes(
        lab, tmp_path, f"{lab.nodes[0].hostname}:29400", (["seed=1"], ["seed=2"])
    )
    for code, out, err, _ in ran:
        assert code != 0
        # c10d numbers the nodes in the order they joined: either may be node 0.
        assert (
            "error: The nodes of this job were started with different configs: "
            "seed, callbacks.resume_state.seed: " in err
        )
        assert "1 on node" in err and "2 on node" in err and "Fix:" in err, err[-3000:]
        # The rank ends with the paragraph and exit code 2; no traceback through our code.
        assert "exitcode  : 2" in err and OUR_TRACEBACK not in err
        assert "epoch 1/" not in out
    assert not list(tmp_path.glob("outputs/**/results.json"))


@pytest.mark.slow
def test_an_interface_that_does_not_exist_stops_every_node_within_a_minute(
    lab: Lab, tmp_path: Path
) -> None:
    ran = torchrun_on_nodes(
        lab,
        tmp_path,
        f"{lab.nodes[0].hostname}:29400",
        (["network.interface=eth9"], []),
        timeout=120,
    )
    errors = "".join(err for _, _, err, _ in ran)
    assert all(code != 0 for code, *_ in ran)
    assert "error: network.interface='eth9' is not valid: an interface of node" in errors
    assert "eth0 " + lab.nodes[0].address in errors or "eth0 " + lab.nodes[1].address in errors
    # The other node names the cause too: node 0 told the job before it ended (left to
    # the closed store, node 1's torchrun could end its worker before it said a word).
    other = ran[1][2]
    assert f"error: Node 0 ({lab.nodes[0].hostname}) cannot start: network.interface='eth9'" in (
        other
    ), other[-3000:]
    assert max(seconds for *_, seconds in ran) < 90  # start-up included
    assert OUR_TRACEBACK not in errors


@pytest.mark.slow
def test_private_disks_stop_with_the_paragraph_alone(lab: Lab, tmp_path: Path) -> None:
    """Each node with its own tmpfs over outputs/ (node-local scratch): refused before
    training, each rank ending with exit code 2 and the paragraph, no traceback."""
    ran = torchrun_on_nodes(lab, tmp_path, f"{lab.nodes[0].hostname}:29400", private_disk=True)
    for code, out, err, _ in ran:
        assert code != 0
        assert "error: The nodes of this job do not share a file system" in err, err[-3000:]
        assert "exitcode  : 2" in err and OUR_TRACEBACK not in err
        assert "epoch 1/" not in out
    assert not list((tmp_path / "outputs").iterdir())  # each node wrote to its own disk


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restart_resumes_on_both_nodes(lab: Lab, tmp_path: Path) -> None:
    """torchrun --max-restarts=1 on each node; the worker of global rank 1 kills itself
    after the step-5 checkpoint: both nodes restart, resume from last.ckpt, finish."""
    steps = [
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=8",
        "callbacks.last_checkpoint.every_n_train_steps=5",
        "+callbacks.kill._target_=faults.KillRankAfterStep",
        "+callbacks.kill.step=5",
    ]
    ran = torchrun_on_nodes(
        lab,
        tmp_path,
        f"{lab.nodes[0].hostname}:29400",
        (steps, steps),
        torchrun_args=("--max-restarts=1",),
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        timeout=600,
    )
    assert [r[0] for r in ran] == [0, 0], [r[2][-3000:] for r in ran]
    assert "failed (exitcode: -9)" in "".join(r[2] for r in ran)  # rank 1 was killed
    record = results(next(tmp_path.glob("outputs/**/results.json")).parent)
    # Rank 0's node restarted for the other's failure (torchrun counts no restart there)
    # and resumed all the same: every node decides from the shared job folder.
    assert record["resumed_from"].endswith("last.ckpt")
    assert record["global_step"] == 16 and record["world_size"] == 2


# --- in-process: the choice of address and the verdict of the nodes ---------------------


def test_a_rendezvous_host_on_loopback_seen_from_another_node_is_refused() -> None:
    from ddp_template.launch.network import choose_endpoint

    with pytest.raises(ConfigError) as err:
        choose_endpoint("localhost", node_rank=1, num_nodes=2)
    message = str(err.value)
    assert err.value.key == "MASTER_ADDR" and "127.0.0.1, a loopback address" in message
    assert "node 1" in message and "--rdzv_endpoint=<IP>" in message


def test_a_name_that_does_not_resolve_and_a_missing_interface_are_named() -> None:
    from ddp_template.launch.network import choose_endpoint, interfaces

    with pytest.raises(ConfigError, match="does not resolve|resolves on node 0"):
        choose_endpoint("no-such-host.invalid", node_rank=0, num_nodes=2)
    with pytest.raises(ConfigError) as err:
        choose_endpoint("localhost", node_rank=0, num_nodes=2, interface="nope0")
    assert err.value.key == "network.interface"
    assert all(name in str(err.value) for name in interfaces())


def test_differing_configs_name_the_key_the_nodes_and_the_fix() -> None:
    from helpers.runs import compose_train

    from ddp_template.worker.node_agreement import _judge, flat_config

    configs = [flat_config(compose_train(f"seed={s}")) for s in (1, 2)]
    ranks = [
        {"node_rank": n, "hostname": f"host{n}", "config": c, "address": "x"}
        for n, c in enumerate(configs)
    ]
    verdict = _judge(ranks, {})
    # The keys that repeat `seed` are named with it, once.
    assert verdict.startswith(
        "The nodes of this job were started with different configs: seed, "
        "callbacks.resume_state.seed: 1 on node 0 (host0), 2 on node 1 (host1)."
    )
    assert "the same command and overrides" in verdict
    ranks[1]["config"] = {**configs[0], "paths.output_dir": "/elsewhere"}
    assert "--rdzv_id" in _judge(ranks, {})
    ranks[1]["config"] = configs[0]
    assert _judge(ranks, {}) == ""


# --- several nodes through this project's own agent -------------------------------------


def _own_agent(lab: Lab, node: int, cwd: Path, *overrides: str) -> subprocess.Popen:
    command = [
        sys.executable,
        TRAIN,
        "strategy=ddp",
        "devices=1",
        "num_nodes=2",
        f"network.node_rank={node}",
        *FAST,
        *overrides,
    ]
    return lab.popen(
        node,
        command,
        cwd=cwd,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_the_own_agent_trains_two_nodes(lab: Lab, tmp_path: Path) -> None:
    """`python train.py num_nodes=2 network.node_rank=N network.master_addr=...` on each
    node: node 0 hosts the rendezvous (whatever its hostname resolves to), one job folder."""
    master = f"network.master_addr={lab.nodes[0].hostname}"
    procs = [_own_agent(lab, n, tmp_path, master, "network.job_id=own") for n in (0, 1)]
    ran = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in ran]
    record = results(tmp_path / "outputs" / "nodes" / "own")
    assert record["world_size"] == 2 and record["num_nodes"] == 2
    assert {n["hostname"] for n in record["nodes"]} == {n.hostname for n in lab.nodes}
    assert "Run summary" in ran[0][0] and "Run summary" not in ran[1][0]


@pytest.mark.slow
def test_the_own_agent_names_a_rendezvous_host_that_does_not_answer(
    lab: Lab, tmp_path: Path
) -> None:
    absent = lab.nodes[0].address.rsplit(".", 1)[0] + ".99"  # in the lab's subnet, nobody
    started = time.monotonic()
    proc = _own_agent(lab, 1, tmp_path, f"network.master_addr={absent}", "network.timeout_s=10")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert err.startswith(f"error: network.master_addr='{absent}' is not valid: node 0's address")
    assert "did not answer within 10 s" in err and "Fix:" in err and "Traceback" not in err
    assert time.monotonic() - started < 60
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.ckpt"))


def test_node_0_must_own_the_rendezvous_address() -> None:
    from ddp_template.launch.network import check_rendezvous_host

    with pytest.raises(ConfigError) as err:
        check_rendezvous_host("192.0.2.250", 29400, node_rank=0, timeout_s=1)
    assert err.value.key == "network.master_addr" and "an address of node 0" in str(err.value)


# --- the lab's own commands ------------------------------------------------------------


def test_a_node_command_finds_this_environment_first() -> None:
    """`netlab run 1 -- torchrun ...` with a virtual environment that is not activated:
    taskset found no `torchrun` on the node's PATH."""
    from ddp_template.tools.netlab import Node

    lab = Lab("stx", [Node(0, "stx-node0", "stx-node0", "10.213.9.10", (0,))], None)
    command = lab.command(0, ["torchrun", "--help"])
    (path,) = [arg for arg in command if arg.startswith("PATH=")]
    assert path.split("=", 1)[1].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    # Set before the node's shell, which execs taskset and the command.
    assert command.index(path) < command.index("sh")


def test_run_takes_its_options_before_the_command() -> None:
    """`run 0 --prefix NAME -- CMD` as docs/nodes.md writes it: the prefix is run's, not
    the command's (it used to look for the default lab)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.netlab", "run", "0", "--prefix", "stnone"]
        + ["--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "No lab named stnone is up" in proc.stderr, proc.stderr


def test_probe_readings_that_disagree_or_fall_short_are_named() -> None:
    from ddp_template.tools.netlab import allreduce_warnings, rate_warnings

    assert rate_warnings("TCP", [950e6, 960e6, 955e6], 10**9) == []
    (spread,) = rate_warnings("TCP", [259.9e6, 960.4e6, 955e6], 10**9)
    assert "readings disagree (259.9mbit to 960.4mbit over 3 readings" in spread
    (short,) = rate_warnings("TCP", [500e6, 510e6, 505e6], 10**9)
    assert "median 505mbit is below 70% of the 1gbit" in short
    assert rate_warnings("TCP", [500e6], None) == []
    measured = {
        "latency_s": 60e-6,
        "latency_readings_s": [50e-6, 60e-6, 55e-6, 26_986e-6, 62e-6],
        "bandwidth_bps": {"float32": 940e6},
        "bandwidth_readings_bps": {"float32": [930e6, 940e6, 945e6]},
    }
    (latency,) = allreduce_warnings(measured, 10**9)
    assert latency.startswith("warning: the latency per hop read 50 to 26,986 us")


def test_the_probes_size_ladder_is_printed_beside_the_models_time_and_the_sum() -> None:
    """Each all-reduce of the ladder beside the model's time (the longer of the bytes' time
    and the hops' waits) and the two added up: at 4 nodes, 1 ms a hop and 1 Gbit/s, 6 ms
    of waits; 4 KiB send 1.5 x 4 KiB in 49 us (the waits count), 4 MiB in 50.3 ms (the
    bytes count, the sum 56.3)."""
    from ddp_template.tools.netlab import ladder_line

    measured = {
        "world": 4,
        "latency_s": 1e-3,
        "bandwidth_bps": {"float32": 1e9},
        "float32_seconds_by_bytes": [[4096.0, 6.5e-3], [float(4 << 20), 52e-3]],
    }
    assert ladder_line(measured) == (
        "all-reduce float32 by size: 4 KiB 6.5 ms (model 6.0, sum 6.0); "
        "4 MiB 52.0 ms (model 50.3, sum 56.3)"
    )
    assert ladder_line({**measured, "float32_seconds_by_bytes": []}).endswith("not measured")


def _docs_lab_recipe() -> str:
    """The fenced block of docs/nodes.md that builds a lab, trains on it and removes it."""
    text = (ROOT / "docs" / "nodes.md").read_text()
    blocks = [b.split("\n```", 1)[0] for b in text.split("```bash\n")[1:]]
    (recipe,) = [b for b in blocks if "netlab up --prefix lab1" in b]
    return recipe


@pytest.mark.slow
def test_the_docs_lab_recipe_runs_as_written() -> None:
    """docs/nodes.md's lab recipe, run as it stands from the project's folder: the venv's
    programs, both nodes' commands at once, a prefix of this test's own (in place of the
    docs' `lab1`, passed as the docs pass it)."""
    try:
        require_namespaces()
    except UserFacingError as why:
        pytest.skip(str(why))
    recipe = _docs_lab_recipe()
    assert recipe.count("--prefix lab1") >= 5 and "run 0 --prefix lab1" in recipe
    assert "run 1 --prefix lab1" in recipe and "&\n" in recipe and "\nwait" in recipe
    prefix = f"st{os.getpid() % 100000}"
    script = recipe.replace("lab1", prefix)
    if not (ROOT / ".venv" / "bin" / "python").is_file():
        # A checkout whose environment lives elsewhere: the running one stands in.
        script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    job = ROOT / "outputs" / "torchrun" / prefix
    try:
        proc = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "median of 5 TCP readings" in proc.stdout
        out = results(job)
        assert out["world_size"] == 2
        assert {n["hostname"] for n in out["nodes"]} == {f"{prefix}-node0", f"{prefix}-node1"}
        assert Lab.load(prefix) is None, "the recipe's last line removes the lab"
    finally:
        lab = Lab.load(prefix)
        if lab is not None:
            lab.down()
        subprocess.run(["rm", "-rf", str(job)], check=False)


@pytest.mark.slow
def test_the_probe_saves_the_link_the_models_take(lab: Lab, tmp_path: Path) -> None:
    """`netlab probe --allreduce --save FILE` over the lab's two nodes: the all-reduce alone
    and while the nodes compute, FSDP's all-gather, and a file that `--link FILE` (and
    `dry_run.link=FILE`) takes as the link; a file name that is not .json is refused
    before anything runs."""
    from ddp_template.tools.scaling import link_of

    probe = [sys.executable, "-m", "ddp_template.tools.netlab", "probe", "--prefix", lab.prefix]
    refused = subprocess.run(
        [*probe, "--allreduce", "--save", str(tmp_path / "probe.txt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error: --save="), refused.stderr
    assert not (tmp_path / "probe.txt").exists()
    saved = tmp_path / "probe.json"
    done = subprocess.run(
        [*probe, "--repeats", "1", "--allreduce", "--save", str(saved)],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "all-gather (FSDP's, counted as a ring's): float32 " in done.stdout
    assert "a rank's CPU: " in done.stdout and " us per all-reduce; per byte sent: " in done.stdout
    assert f"saved to {saved}" in done.stdout
    link = link_of(str(saved), 5e-5, "--link")
    measured = json.loads(saved.read_text())
    assert link.gather_bandwidth_bps == measured["all_gather_bandwidth_bps"] > 0
    assert link.busy_bandwidth_bps is not None and 0 < link.compute_share <= 1
    # What a collective costs a rank's CPU: the model's CPU lane takes it from the file.
    assert link.cores is not None and link.cores > 0 and link.cpu_s_per_call > 0
    # A shaped link of 1 Gbit/s: no collective measures faster than the rate.
    assert 0 < max(measured["bandwidth_bps"].values()) < 1.2e9
