"""Jobs of many nodes: the start-up check's traffic per rank does not grow with the job,
and a job of 32 real lab nodes (each its own network namespace, hostname and address, one
torchrun agent and one worker each) starts and trains."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch.distributed as dist
from helpers.runs import FAST, ROOT, results, subprocess_env

from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.launch.network import Endpoint
from ddp_template.tools.netlab import Lab, require_namespaces
from ddp_template.worker.node_agreement import NodesDisagree, check_nodes, start_wait

# One SLURM and one lab at a time: under pytest-xdist (README's test command) the tests of
# this group run in one worker, one after another (their clusters share names, addresses
# and the one-machine SLURM's CPUs).
pytestmark = pytest.mark.xdist_group("cluster")


class CountingBoard:
    """The real store, with each request and each key it names counted."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests: Counter[str] = Counter()
        self.keys = 0

    def _count(self, name: str, keys: int = 1) -> None:
        self.requests[name] += 1
        self.keys += keys

    def set(self, key: str, value: str) -> None:
        self._count("set")
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.store.get(key)

    def check(self, keys: list[str]) -> bool:
        self._count("check", len(keys))
        return self.store.check(keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._count("wait", len(keys))
        self.store.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get", len(keys))
        return self.store.multi_get(keys)


def start_check_in_threads(
    num_nodes: int, per_node: int, config_of=lambda node: {"seed": 1}, tcp: bool = False
) -> tuple[list[CountingBoard], list[Any]]:
    """Every rank of a job of `num_nodes` x `per_node` as a thread; returns each rank's
    board and outcome. The store is c10d's: a HashStore shared by the threads, or with
    `tcp` one TCPStore on loopback and a client per rank (a client's connect here sometimes
    stalls 5 s beyond about 24 clients, so the large counts use the HashStore)."""
    world = num_nodes * per_node
    boards: list[CountingBoard] = []
    if tcp:
        server = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
        stores = [dist.TCPStore("127.0.0.1", server.port, world, False) for _ in range(world)]
    else:
        stores = [dist.HashStore()] * world
    for store in stores:
        boards.append(CountingBoard(dist.PrefixStore("ddp_template/start/", store)))
    outcome: list[Any] = [None] * world

    def rank_main(rank: int) -> None:
        node = rank // per_node
        try:
            outcome[rank] = check_nodes(
                boards[rank],
                {**config_of(node), "network.node_rank": node},
                Endpoint(f"host{node}", "127.0.0.1", "lo", "test"),
                rank=rank,
                world_size=world,
                node_rank=node,
                local_rank=rank % per_node,
                num_nodes=num_nodes,
                wait=timedelta(seconds=60),
                where="127.0.0.1",
            )
        except BaseException as err:  # noqa: BLE001 - the test reads what each rank raised
            outcome[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a rank hung at the start-up check"
    return boards, outcome


def _per_role(boards: list[CountingBoard], per_node: int) -> dict[str, tuple[int, int]]:
    """The most requests and keys of any rank of each role."""
    roles: dict[str, list[CountingBoard]] = {"rank 0": boards[:1], "leader": [], "other": []}
    for rank, board in enumerate(boards[1:], start=1):
        roles["leader" if rank % per_node == 0 else "other"].append(board)
    return {
        role: (max(sum(b.requests.values()) for b in bs), max(b.keys for b in bs))
        for role, bs in roles.items()
    }


def test_start_up_requests_per_rank_do_not_grow_with_the_job() -> None:
    """8 and 32 nodes of 2 ranks on one real store: every rank makes the same number of
    requests at both sizes (before, each read all W ranks' keys: 16 against 64 reads);
    only rank 0 names O(W) keys, in a fixed number of requests."""
    counted = {}
    for nodes in (8, 32):
        boards, outcome = start_check_in_threads(nodes, per_node=2)
        assert all(isinstance(o, list) for o in outcome), outcome
        assert len(outcome[0]) == nodes and all(o == [] for o in outcome[1:])
        counted[nodes] = _per_role(boards, per_node=2)
    small, large = counted[8], counted[32]
    for role in ("rank 0", "leader", "other"):
        assert small[role][0] == large[role][0], (role, small, large)
    assert small["leader"][1] == large["leader"][1] and small["other"][1] == large["other"][1]
    # Rank 0 reads the 2W arrivals and the N entries and probes: linear in W, no more.
    assert large["rank 0"][1] <= 4 * small["rank 0"][1]
    # Every node's leader probed node 0 and the next node: 32 connects to node 0 worked.
    assert small["other"][0] <= 3 and small["leader"][0] <= 8


def test_configs_that_differ_are_fetched_and_named_on_every_rank() -> None:
    """Digests first; rank 0 reads full configs only when they differ, and every rank
    stops with the same paragraph naming the key and the nodes."""
    boards, outcome = start_check_in_threads(
        8, per_node=2, config_of=lambda node: {"seed": 2 if node == 5 else 1}, tcp=True
    )
    assert all(isinstance(o, NodesDisagree) for o in outcome), outcome
    messages = {str(o) for o in outcome}
    assert len(messages) == 1
    message = messages.pop()
    assert message.startswith("The nodes of this job were started with different configs: seed:")
    assert "seed: 1 on nodes 0-4,6-7, 2 on node 5 (host5)." in message
    assert "network.node_rank" not in message


def test_the_wait_grows_with_the_job() -> None:
    assert start_wait(45, 2).total_seconds() == pytest.approx(45.2)
    assert start_wait(45, 1000).total_seconds() == pytest.approx(145)


# --- a lab the machine cannot hold --------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "refused"),
    [
        ({"nodes": 300}, "--nodes=300 is not valid: at most 245 nodes"),
        ({"nodes": 32, "cpu_fraction": "0.5"}, "--cpu-fraction='0.5' is not valid: at most"),
        ({"nodes": 4, "cpu_fraction": "fast"}, "--cpu-fraction='fast' is not valid"),
        ({"nodes": 32, "memory_per_node_mb": 10**7}, "--memory-per-node=10000000 is not valid"),
    ],
)
def test_a_lab_the_machine_cannot_hold_is_refused_before_anything_is_built(
    shape: dict[str, Any], refused: str
) -> None:
    prefix = f"se{os.getpid() % 100000}"
    with pytest.raises(ConfigError) as err:
        Lab.up(prefix=prefix, **shape)
    assert str(err.value).startswith(refused) and "Fix:" in str(err.value)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in namespaces and not Lab.load(prefix)
    assert not list(Path("/sys/fs/cgroup/cpu").glob(f"{prefix}-*"))


def test_the_lab_refuses_in_one_paragraph_on_the_command_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.netlab", "up", "--nodes", "300"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: --nodes=300 is not valid")
    assert "Fix:" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_cpu_fraction_is_each_nodes_share_of_the_cores() -> None:
    from ddp_template.tools.netlab import plan_capacity

    cores = len(os.sched_getaffinity(0))
    assert plan_capacity(8, "auto", 0) == pytest.approx(cores / 8)
    assert plan_capacity(8, None, 0) is None
    assert plan_capacity(8, str(cores / 8), 0) == pytest.approx(cores / 8)


def test_the_lab_holds_each_nodes_quota_over_the_period_asked() -> None:
    """A node of 0.2 core at a 5 ms period runs 1 ms and waits at most 4; at the kernel's
    100 ms it waits up to 80, and every barrier of a job waits for the node stopped longest.
    The validation's lab (`scaling_validation.lab_for`) holds its nodes at the period its
    one-node run had (before: the lab's cgroups kept the kernel's 100 ms whatever the
    validation was asked)."""
    require_namespaces()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling_validation

    prefix = f"cp{os.getpid() % 100000}"
    args = SimpleNamespace(
        rate_list=["1gbit"], prefix=prefix, current=0.2, link_from="lab", cfs_period_us=5000
    )
    lab = scaling_validation.lab_for(args, 2)
    try:
        for node in lab.nodes:
            group = Path("/sys/fs/cgroup/cpu") / str(node.cgroup)
            assert (group / "cpu.cfs_period_us").read_text().strip() == "5000"
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "1000"
        assert python_on_node(lab, 1, QUOTA_SEEN) == ["0.2"]
        assert "0.2 of a core per node (cgroup cpu quota, period 5 ms)" in lab.describe()
    finally:
        lab.down()


QUOTA_SEEN = "from ddp_template.launch import topology as t; print(t.cpu_quota_cores())"


def python_on_node(lab: Lab, index: int, code: str) -> list[str]:
    """The words `code` prints, run by this interpreter on node `index` of the lab."""
    seen = subprocess.run(
        lab.command(index, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert seen.returncode == 0, seen.stderr
    return seen.stdout.split()


@pytest.mark.parametrize(
    ("fraction", "period", "says"),
    [
        ("0.2", "4000", "a period that holds 0.2 of a core"),
        ("0.5", "500", "an integer from 1000 to 1000000"),
    ],
)
def test_a_quota_period_the_kernel_cannot_hold_is_one_paragraph_and_builds_nothing(
    fraction: str, period: str, says: str
) -> None:
    prefix = f"cb{os.getpid() % 100000}"
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.netlab", "up", "--nodes", "2"]
        + ["--cpu-fraction", fraction, "--cpu-period-us", period, "--prefix", prefix],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: --cpu-period-us={period} is not valid"), proc.stderr
    assert says in proc.stderr and "Fix:" in proc.stderr and proc.stderr.count("\n") == 1
    assert Lab.load(prefix) is None
    assert not (Path("/sys/fs/cgroup/cpu") / f"{prefix}-node0").exists()


def test_a_node_with_a_cpu_fraction_sees_its_quota_and_runs_one_thread() -> None:
    """A lab node's processes read their cgroup's quota as a container's do (the /sys of
    `ip netns exec` has no cgroup tree; the lab mounts the node's own): 0.5 of a core gives
    one torch thread and no loader worker, as the one-node run pinned to a core that the
    scaling model is fed (before: two threads and a worker under a 0.5 quota)."""
    require_namespaces()
    lab = Lab.up(2, "1gbit", prefix=f"cq{os.getpid() % 100000}", cpu_fraction=0.5)
    try:
        # Threads as a rank of a DDP job sets them: the project's count, then Lightning's
        # DDP set-up (which would go by the affinity mask alone).
        code = (
            "import torch; from ddp_template.launch import topology as t; "
            "from ddp_template.train import _cpu_threads; "
            "from lightning.fabric.utilities.distributed import _set_num_threads_if_needed; "
            "\nwith _cpu_threads(1): _set_num_threads_if_needed(1); "
            "print(t.available_cores(), t.cpu_quota_cores(), t.workers_per_rank(1, 0), "
            "torch.get_num_threads())"
        )
        assert python_on_node(lab, 1, code) == ["1", "0.5", "0", "1"]
    finally:
        lab.down()
    # The node's mount stayed inside it.
    assert Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").is_file()


# --- a job of many real nodes on the lab --------------------------------------------------

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TRAIN = str(ROOT / "train.py")
# Each node's agent and worker: the regression task on 4 samples per batch, 2 steps.
TINY_RUN = [
    "task=regression",
    "strategy=ddp",
    *[o for o in FAST if not o.startswith("trainer.limit_train")],
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "data.batch_size=4",
    "data.num_workers=0",
]


def _memory_mb(root: psutil.Process) -> tuple[float, float]:
    """The memory a node's processes hold now: the resident set of the tree under `root`,
    and its proportional set (PSS: a page shared by k processes counts 1/k; summed over
    the tree, what one more node costs the machine, libraries mapped once for all)."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    rss = pss = 0
    for member in tree:
        with contextlib.suppress(psutil.Error):
            info = member.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
    return rss / 2**20, pss / 2**20


def agent_args(lab: Lab, agent: str, stamp: Path, node: str) -> list[str]:
    """A node's command line after the interpreter: torchrun's, or train.py as this
    project's own agent (node 0 hosts the rendezvous)."""
    run = [
        *TINY_RUN,
        "+callbacks.stamp._target_=stamps.StampFirstStep",
        f"+callbacks.stamp.path={stamp}",
    ]
    nodes = len(lab.nodes)
    if agent == "torchrun":
        return [
            TORCHRUN,
            f"--nnodes={nodes}",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={lab.nodes[0].hostname}:29400",
            f"--rdzv_id=many{os.getpid()}",
            TRAIN,
            *run,
        ]
    return [
        TRAIN,
        *run,
        "devices=1",
        f"num_nodes={nodes}",
        f"network.node_rank={node}",
        f"network.master_addr={lab.nodes[0].hostname}",
        f"network.job_id=many{os.getpid()}",
        # The agents' rendezvous waits for the last node to import and check its config:
        # minutes at 32 nodes on 2 shared cores when each imports torch itself.
        "network.timeout_s=900",
    ]


def job_on_lab_nodes(lab: Lab, cwd: Path, timeout: float, agent: str) -> dict[str, Any]:
    """One agent per node of `lab`, one worker each: `torchrun`, `own` (train.py as its
    own agent, which forks its worker) or `forked` (the own agent on every node, forked
    from one process that imported torch and Lightning once: `netlab_fork`). Returns
    each node's exit code and output tail, the seconds from the last node's start to
    rank 0's first training step, and the largest memory one node's processes held."""
    cwd.mkdir(parents=True, exist_ok=True)
    stamp = cwd / "first_step"
    env = subprocess_env(OMP_NUM_THREADS="1")
    procs = []
    if agent == "forked":
        zygote = [sys.executable, "-m", "ddp_template.tools.netlab_fork", "--prefix"]
        command = [
            *zygote,
            lab.prefix,
            "--logs",
            str(cwd),
            "--",
            *agent_args(lab, "own", stamp, "{node}"),
        ]
        procs.append(
            subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
            )
        )
    else:
        for node in lab.nodes:
            log = (cwd / f"node{node.index}.log").open("w")
            args = agent_args(lab, agent, stamp, str(node.index))
            command = args if agent == "torchrun" else [sys.executable, *args]
            procs.append(
                lab.popen(
                    node.index, command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
        (cwd / "started").write_text(repr(time.time()))
    deadline = time.monotonic() + timeout
    peak_rss = peak_pss = 0.0
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            roots = [psutil.Process(p.pid) for p in procs if p.poll() is None]
            if agent == "forked":
                with contextlib.suppress(psutil.Error):
                    roots = roots[0].children() if roots else []
            for rss, pss in map(_memory_mb, roots):
                peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                if agent == "forked":
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
    if agent == "forked":
        out = procs[0].stdout.read() if procs[0].stdout else ""
        codes_of = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        codes = [codes_of.get(str(n.index)) for n in lab.nodes]
    else:
        codes = [p.returncode for p in procs]
    outputs = [(cwd / f"node{n.index}.log").read_text() for n in lab.nodes]
    started = float((cwd / "started").read_text()) if (cwd / "started").exists() else None
    return {
        "codes": codes,
        "tails": [out[-2000:] for out in outputs],
        "to_first_step_s": float(stamp.read_text()) - started
        if stamp.exists() and started
        else None,
        "peak_node_rss_mb": peak_rss,
        "peak_node_pss_mb": peak_pss,
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nodes", [32])
def test_a_job_of_many_lab_nodes_starts_and_trains(tmp_path: Path, nodes: int) -> None:
    """`nodes` namespaced nodes, each its own hostname and address, one torchrun agent and
    one worker each: one job of world size `nodes`, one results.json naming every node.
    Before, node 0's probe socket accepted no connection and from 18 nodes the job
    stopped with a message blaming the interface."""
    try:
        require_namespaces()
    except UserFacingError as why:
        pytest.skip(str(why))
    lab = Lab.up(nodes, "1gbit", prefix=f"sc{os.getpid() % 100000}", memory_per_node_mb=250)
    try:
        ran = job_on_lab_nodes(lab, tmp_path, timeout=1500, agent="forked")
    finally:
        lab.down()
    print(
        f"{nodes} nodes: {ran['to_first_step_s']:.1f} s from the last start to the first "
        f"step; per node at most {ran['peak_node_rss_mb']:.0f} MiB resident, "
        f"{ran['peak_node_pss_mb']:.0f} MiB proportional"
        if ran["to_first_step_s"] is not None
        else f"{nodes} nodes: no training step"
    )
    assert ran["codes"] == [0] * nodes, [
        t for c, t in zip(ran["codes"], ran["tails"], strict=True) if c
    ]
    written = list(tmp_path.glob("outputs/**/results.json"))
    assert len(written) == 1
    record = results(written[0].parent)
    assert record["world_size"] == nodes and record["num_nodes"] == nodes
    assert {n["hostname"] for n in record["nodes"]} == {n.hostname for n in lab.nodes}
    assert {n["address"] for n in record["nodes"]} == {n.address for n in lab.nodes}
    assert record["global_step"] == 2
