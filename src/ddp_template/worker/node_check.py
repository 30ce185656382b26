"""The start of a job of several nodes: every rank checks, before the process group
exists, that the nodes can work together, and all stop together with one paragraph when
they cannot.

torchrun and srun start each node's processes separately, from each node's own command
line, disk and network set-up. What goes wrong there shows late or never: a backend bound
to a loopback address (a silent hang in the first collective, or `connectFullMesh failed`),
a node that cannot reach another, a node started with another config (`seed=1` on one,
`seed=2` on the other trains without a word). So, on the rendezvous store that
`init_process_group` would use anyway:

1. every rank picks its interface and address (`network.choose_endpoint`) and makes its
   backend bind there;
2. it publishes them; the first rank of each node also publishes the node's config and a
   listening socket on that address;
3. the first rank of each node connects to node 0's socket and to the next node's: the
   addresses the backend will use are reachable from where they will be used;
4. rank 0 compares the configs and the probes and publishes one verdict; a fault stops
   every rank with the same message (exit code 2), naming the keys, nodes and addresses;
5. the process group starts on the same store (Lightning then uses it as it is).

Every wait is bounded by `network.timeout_s`: a rank that never arrives (it failed, or
cannot reach the rendezvous host) is named by the others within that time, instead of a
hang until the collective timeout (30 minutes).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from torch.distributed.constants import default_pg_timeout

from ddp_template.errors import TrainingStopped
from ddp_template.launch.network import Endpoint, choose_endpoint, use_endpoint
from ddp_template.worker.comm_hooks import CommHookDDPStrategy

# Keys that may differ between nodes: they describe where a node is, not what it trains.
NODE_LOCAL_KEYS = ("network.interface", "network.node_rank")
# What the report and results.json show of each node (set on every rank, filled on rank 0).
NODES: list[dict[str, Any]] = []


class NodesDisagree(TrainingStopped):
    """The nodes of one job cannot train together; the message says why and how to fix it."""


def start_process_group(
    config: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    node_rank: int,
    local_rank: int,
    num_nodes: int,
    main_address: str,
    main_port: int,
    backend: str,
    timeout: timedelta,
    device_id: Any = None,
) -> list[dict[str, Any]]:
    """Runs the checks above, then `init_process_group`; returns every rank's endpoint.
    `config` is the flat config the nodes compare (`comparable_config`)."""
    wait = timedelta(seconds=float(config.get("network.timeout_s", 45)))
    endpoint = choose_endpoint(
        main_address, node_rank, num_nodes, config.get("network.interface"), main_port
    )
    use_endpoint(endpoint)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = main_address, str(main_port)
    store = _rendezvous_store(rank, world_size, wait, endpoint, main_address, main_port)
    # Each attempt gets a store of its own (the agent makes one per rendezvous round), so
    # no key of an earlier attempt is read. Not the restart count: a node restarted for
    # another node's failure counts no restart of its own.
    board = dist.PrefixStore("ddp_template/start/", store)

    leader = local_rank == 0
    listener = _listen(endpoint.address) if leader else None
    mine = {**asdict(endpoint), "rank": rank, "node_rank": node_rank}
    if leader:
        mine["config"] = config
        mine["probe_port"] = listener.getsockname()[1] if listener else None
    board.set(f"rank/{rank}", json.dumps(mine))
    where = f"{main_address}:{main_port}"
    ranks = _gather(board, rank, world_size, wait, endpoint, node_rank, where)
    if leader:
        board.set(f"reach/{node_rank}", json.dumps(_probe_peers(ranks, node_rank, num_nodes)))
    try:
        verdict = _verdict(board, ranks, rank, num_nodes, wait)
    except NodesDisagree:
        raise
    except Exception:
        raise _store_gone(rank, endpoint, node_rank, where) from None
    if listener is not None:
        listener.close()
    if verdict:
        _all_have_read(board, rank, world_size)
        raise NodesDisagree(verdict)

    store.set_timeout(timeout)
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )
    NODES[:] = [{k: v for k, v in r.items() if k != "config"} for r in ranks if "config" in r]
    return ranks


def _rendezvous_store(rank, world_size, wait, endpoint: Endpoint, address: str, port: int):
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=wait))
    except (RuntimeError, TimeoutError, OSError) as err:
        role = "host the rendezvous store at" if rank == 0 else "reach the rendezvous store at"
        raise NodesDisagree(
            f"Rank {rank} on {endpoint.hostname} ({endpoint.address}, {endpoint.interface}) "
            f"could not {role} {address}:{port} within {wait.total_seconds():.0f} s: "
            f"{_first_line(err)}. Every rank of the job connects there before training. "
            f"Fix: check that {address} is node 0's address as seen from this node and that "
            f"port {port} is open between the nodes (firewall, security group), and that every "
            "node was started (network.timeout_s sets how long each waits)"
        ) from None
    return store


def _gather(
    board,
    rank: int,
    world_size: int,
    wait: timedelta,
    endpoint: Endpoint,
    node_rank: int,
    where: str,
):
    keys = [f"rank/{r}" for r in range(world_size)]
    try:
        board.wait(keys, wait)
    except Exception:
        try:
            missing = [r for r, key in enumerate(keys) if not board.check([key])]
        except Exception:
            raise _store_gone(rank, endpoint, node_rank, where) from None
        raise NodesDisagree(
            f"Rank(s) {', '.join(map(str, missing))} did not reach the start of the job "
            f"within {wait.total_seconds():.0f} s (seen from node {node_rank}, "
            f"{endpoint.hostname}): they failed before it (see their output) or cannot "
            "reach this job's rendezvous store. Fix: look at those ranks' output, start "
            "every node with the same command, or raise network.timeout_s when nodes start "
            "far apart"
        ) from None
    return [json.loads(board.get(key)) for key in keys]


def _store_gone(rank: int, endpoint: Endpoint, node_rank: int, where: str) -> NodesDisagree:
    return NodesDisagree(
        f"The job's rendezvous store at {where} closed while rank {rank} on node {node_rank} "
        f"({endpoint.hostname}) waited at the start of the job: the node that hosts it "
        "stopped. Fix: see node 0's output for why (its message names the cause)"
    )


def _listen(address: str) -> socket.socket | None:
    listener = socket.socket()
    try:
        listener.bind((address, 0))
    except OSError:
        listener.close()
        return None
    listener.listen(16)
    listener.settimeout(0.2)
    return listener


def _probe_peers(ranks: list[dict[str, Any]], node_rank: int, num_nodes: int) -> list[dict]:
    """Connects to node 0's and the next node's sockets: the backend will need both."""
    leaders = {r["node_rank"]: r for r in ranks if "config" in r}
    targets = sorted({0, (node_rank + 1) % num_nodes} - {node_rank})
    failures = []
    for target in targets:
        peer = leaders.get(target)
        if peer is None or peer.get("probe_port") is None:
            failures.append(
                {"node": target, "address": peer and peer["address"], "error": "no socket"}
            )
            continue
        try:
            socket.create_connection((peer["address"], peer["probe_port"]), timeout=10).close()
        except OSError as err:
            failures.append({"node": target, "address": peer["address"], "error": _first_line(err)})
    return failures


def _verdict(board, ranks, rank: int, num_nodes: int, wait: timedelta) -> str:
    """Rank 0 judges and publishes; the others read the same words."""
    if rank == 0:
        reach_keys = [f"reach/{n}" for n in range(num_nodes)]
        try:
            board.wait(reach_keys, wait)
            reach = {n: json.loads(board.get(f"reach/{n}")) for n in range(num_nodes)}
        except Exception:
            reach = {}
        verdict = _judge(ranks, reach)
        board.set("verdict", verdict)
        # The others read the verdict before rank 0 moves on (and may close the store).
        return verdict
    deadline = time.monotonic() + 2 * wait.total_seconds()
    while time.monotonic() < deadline:
        if board.check(["verdict"]):
            return board.get("verdict").decode()
        time.sleep(0.05)
    return "Rank 0 gave no verdict on the start of the job in time. Fix: see rank 0's output"


def _all_have_read(board, rank: int, world_size: int) -> None:
    """Before a refusal ends this rank: rank 0 (whose node may host the store) waits until
    every rank has read the verdict, so that each prints the cause, not a lost store."""
    try:
        board.set(f"read/{rank}", "1")
        if rank == 0:
            board.wait([f"read/{r}" for r in range(world_size)], timedelta(seconds=10))
    except Exception:
        pass


def _judge(ranks: list[dict[str, Any]], reach: dict[int, list[dict]]) -> str:
    leaders = {r["node_rank"]: r for r in ranks if "config" in r}
    problems = []
    differing = _differing_keys(leaders)
    if differing:
        # Keys that only repeat another (`seed: ${seed}` elsewhere) differ the same way:
        # named together, the key a user sets first.
        grouped: dict[str, list[str]] = {}
        values_of: dict[str, dict[int, Any]] = {}
        for key, values in differing:
            signature = json.dumps(values, sort_keys=True)
            grouped.setdefault(signature, []).append(key)
            values_of[signature] = values
        shown = "; ".join(
            ", ".join(sorted(keys, key=lambda k: (k.count("."), k)))
            + ": "
            + ", ".join(
                f"{json.dumps(values_of[sig].get(n))} on node {n} ({leaders[n]['hostname']})"
                for n in sorted(values_of[sig])
            )
            for sig, keys in list(grouped.items())[:8]
        )
        more = f" (and {len(grouped) - 8} more keys)" if len(grouped) > 8 else ""
        folders = any(key.startswith("paths.") for keys in grouped.values() for key in keys)
        fix = (
            "start every node in the same directory of a shared file system with the same "
            "job id (torchrun --rdzv_id=<job>; without it each node names its own folder)"
            if folders
            else "start every node with the same command and overrides"
        )
        problems.append(
            f"The nodes of this job were started with different configs: {shown}{more}. "
            "Every node must train the same thing in the same job folder, or the ranks "
            "would silently train different models, resume from different checkpoints or "
            f"wait for each other forever. Fix: {fix}"
        )
    for node, failures in sorted(reach.items()):
        for failure in failures:
            source = leaders.get(node, {})
            target = leaders.get(failure["node"], {})
            problems.append(
                f"Node {node} ({source.get('hostname')}, {source.get('address')} on "
                f"{source.get('interface')}) cannot reach node {failure['node']} "
                f"({target.get('hostname')}) at {failure['address']}, the address its backend "
                f"will use ({target.get('interface')}, chosen by {target.get('chosen_by')}): "
                f"{failure['error']}. Fix: set network.interface=<the interface on the "
                "nodes' shared network> (or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), and "
                "make each node's hostname resolve to that network's address"
            )
    return " ".join(problems)


def _differing_keys(leaders: dict[int, dict[str, Any]]) -> list[tuple[str, dict[int, Any]]]:
    configs = {n: leader["config"] for n, leader in leaders.items()}
    keys = sorted(set().union(*configs.values())) if configs else []
    differing = []
    for key in keys:
        if any(key == k or key.startswith(f"{k}.") for k in NODE_LOCAL_KEYS):
            continue
        values = {n: config.get(key) for n, config in configs.items()}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            differing.append((key, values))
    return differing


def flat_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as `dotted.key: value`, as the nodes compare it."""
    from omegaconf import OmegaConf

    from ddp_template.config import dotted

    return dotted(OmegaConf.to_container(cfg, resolve=True))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class NodeCheckedDDPStrategy(CommHookDDPStrategy):
    """The project's DDP strategy, with the checks above before the process group of a job
    of several nodes (one node needs none: its processes share one config and machine)."""

    def __init__(self, node_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.node_config = node_config or {}

    def setup_distributed(self) -> None:
        if self.num_nodes > 1 and not dist.is_initialized():
            reset_seed()
            self.set_world_ranks()
            env = self.cluster_environment
            assert env is not None
            start_process_group(
                self.node_config,
                rank=self.global_rank,
                world_size=self.world_size,
                node_rank=self.node_rank,
                local_rank=self.local_rank,
                num_nodes=self.num_nodes,
                main_address=env.main_address,
                main_port=env.main_port,
                backend=self._get_process_group_backend(),
                timeout=self._timeout or default_pg_timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
        super().setup_distributed()


def nodes_of_job() -> list[dict[str, Any]]:
    """Each node's hostname, address and interface as checked at the start (rank 0), or
    this machine's hostname for a job of one node."""
    return list(NODES) or [{"node_rank": 0, "hostname": socket.gethostname()}]


def describe_nodes() -> str:
    """The start-up report's row: where each node's backend binds, and why there."""
    if not NODES:
        return f"one node ({socket.gethostname()}): ranks talk over loopback"
    return "; ".join(
        f"node {n['node_rank']} {n['hostname']}: {n['address']} on {n['interface']} "
        f"({n['chosen_by']})"
        for n in NODES
    )
