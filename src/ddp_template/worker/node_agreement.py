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
2. it announces itself with one small key; the first rank of each node (its leader) also
   publishes the node's entry (endpoint, a listening socket, the digest of its config)
   and its full config;
3. each leader connects to node 0's socket and to the next node's: the addresses the
   backend will use are reachable from where they will be used (the sockets accept in
   a thread, so hundreds of nodes can connect to node 0 at once);
4. rank 0 reads every arrival and entry in one request each, compares the digests (the
   full configs only where they differ) and the probes, and publishes one verdict, which
   the others wait for; a fault stops every rank with the same message (exit code 2),
   naming the keys, nodes and addresses;
5. the process group starts on the same store (Lightning then uses it as it is).

Each rank makes the same few requests whatever the job's size (rank 0 names all W keys
in them): the start-up traffic is O(W) per job, not O(W^2). Every wait is bounded by
`start_wait` (`network.timeout_s` plus 0.1 s per rank): a rank that never arrives (it
failed, or cannot reach the rendezvous host) is named by rank 0 within that time, instead
of a hang until the collective timeout (30 minutes).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from torch.distributed.constants import default_pg_timeout

from ddp_template.errors import TrainingStopped, UserFacingError
from ddp_template.launch.leaving import leave_process_group_at_exit, remember_job_store
from ddp_template.launch.network import Endpoint, choose_endpoint, use_endpoint
from ddp_template.worker.comm_hooks import CommHookDDPStrategy

# Keys that may differ between nodes: they describe where a node is, not what it trains.
NODE_LOCAL_KEYS = ("network.interface", "network.node_rank")
# What the report and results.json show of each node (set on every rank, filled on rank 0).
NODES: list[dict[str, Any]] = []


class NodesDisagree(TrainingStopped):
    """The nodes of one job cannot train together; the message says why and how to fix it."""


def start_wait(timeout_s: float, world_size: int) -> timedelta:
    """How long each rank waits at the start: `network.timeout_s`, plus a share per rank.
    The skew between the first and the last rank to arrive grows with the job (W processes
    importing from one shared file system, W requests served in turn by the store's host),
    so one fixed wait that suits 2 nodes stops a job of 1,000 ranks that is merely slow."""
    return timedelta(seconds=float(timeout_s) + START_WAIT_PER_RANK_S * world_size)


# Seconds added to `network.timeout_s` per rank: 100 s more at 1,000 ranks.
START_WAIT_PER_RANK_S = 0.1


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
    """Runs the checks above, then `init_process_group`; returns each node's entry (on
    rank 0; other ranks get an empty list). `config` is the flat config the nodes compare
    (`flat_config`)."""
    wait = start_wait(float(config.get("network.timeout_s", 45)), world_size)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = main_address, str(main_port)
    try:
        endpoint = choose_endpoint(
            main_address, node_rank, num_nodes, config.get("network.interface"), main_port
        )
    except UserFacingError as refusal:
        if rank == 0:
            _refuse_for_the_job(refusal, world_size, wait)
        raise
    use_endpoint(endpoint)
    store = _rendezvous_store(rank, world_size, wait, endpoint, main_address, main_port)
    # Each attempt gets a store of its own (the agent makes one per rendezvous round), so
    # no key of an earlier attempt is read. Not the restart count: a node restarted for
    # another node's failure counts no restart of its own.
    board = dist.PrefixStore("ddp_template/start/", store)
    remember_job_store(board, rank, world_size)
    nodes = check_nodes(
        board,
        config,
        endpoint,
        rank=rank,
        world_size=world_size,
        node_rank=node_rank,
        local_rank=local_rank,
        num_nodes=num_nodes,
        wait=wait,
        where=f"{main_address}:{main_port}",
    )
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
    NODES[:] = [{k: v for k, v in n.items() if k not in ("config", "digest")} for n in nodes]
    return nodes


def check_nodes(
    board: Any,
    config: dict[str, Any],
    endpoint: Endpoint,
    *,
    rank: int,
    world_size: int,
    node_rank: int,
    local_rank: int,
    num_nodes: int,
    wait: timedelta,
    where: str,
) -> list[dict[str, Any]]:
    """Steps 2-4 above on `board` (the job's store, or anything with its set/get/wait/
    check/multi_get). Each rank makes a fixed number of requests whatever the job's size:
    a rank announces itself with one small key; only node leaders publish a node's entry
    (endpoint, probe port, the config's digest) and its full config, which rank 0 reads
    only when digests differ; rank 0 reads the W arrivals and N entries in one request
    each; the others block on the verdict. Returns the nodes' entries on rank 0, else [].
    Raises NodesDisagree, the same paragraph on every rank, when they cannot train."""
    leader = local_rank == 0
    listener = ProbeListener(endpoint.address, num_nodes) if leader else None
    try:
        try:
            board.set(f"rank/{rank}", str(node_rank))
            if leader:
                entry = {
                    **asdict(endpoint),
                    "rank": rank,
                    "node_rank": node_rank,
                    "digest": config_digest(config),
                    "probe_port": listener.port if listener else None,
                }
                board.set(f"config/{node_rank}", json.dumps(config))
                board.set(f"node/{node_rank}", json.dumps(entry))
                peers = _peer_entries(board, node_rank, num_nodes, wait)
                board.set(f"reach/{node_rank}", json.dumps(_probe_peers(peers, node_rank)))
            if rank == 0:
                nodes, verdict = _judge_job(board, world_size, num_nodes, wait)
                board.set("verdict", verdict)
            else:
                nodes, verdict = [], _read_verdict(board, wait)
        except NodesDisagree:
            raise
        except Exception:
            raise _store_gone(rank, endpoint, node_rank, where) from None
    finally:
        if listener is not None:
            listener.close()
    if verdict:
        # Every rank raises; rank 0, whose node may host the store, leaves last
        # (launch/leaving.py), so that each prints the cause, not a lost store.
        raise NodesDisagree(verdict)
    return nodes


def config_digest(config: dict[str, Any]) -> str:
    """What the nodes compare first: a hash of every key but where the node is. Nodes
    with equal digests agree; rank 0 reads the full configs only when they differ."""
    shared = {k: v for k, v in config.items() if not _is_node_local(k)}
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()


def _is_node_local(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in NODE_LOCAL_KEYS)


def _peer_entries(board: Any, node_rank: int, num_nodes: int, wait: timedelta) -> dict[int, Any]:
    """The entries of node 0 and of the next node, the two this node's leader probes (a
    node that does not come within `wait` is absent: rank 0 names it)."""
    targets = sorted({0, (node_rank + 1) % num_nodes} - {node_rank})
    keys = [f"node/{n}" for n in targets]
    try:
        board.wait(keys, wait)
    except Exception:
        return {n: None for n in targets}
    return {n: json.loads(raw) for n, raw in zip(targets, board.multi_get(keys), strict=True)}


def _judge_job(
    board: Any, world_size: int, num_nodes: int, wait: timedelta
) -> tuple[list[dict[str, Any]], str]:
    """Rank 0: every rank arrived, then the nodes' entries, configs and probes."""
    arrivals = [f"rank/{r}" for r in range(world_size)]
    try:
        board.wait(arrivals, wait)
    except Exception:
        # Only on the way to a refusal: which ones are missing, one request each.
        missing = [r for r, key in enumerate(arrivals) if not board.check([key])]
        return [], _missing_ranks(missing, wait)
    raw = board.multi_get([f"node/{n}" for n in range(num_nodes)])
    nodes = [json.loads(entry) for entry in raw]
    by_digest: dict[str, list[int]] = {}
    for node in nodes:
        by_digest.setdefault(node["digest"], []).append(node["node_rank"])
    if len(by_digest) > 1:
        # One full config per distinct digest, lent to every node that shares it.
        firsts = [members[0] for members in by_digest.values()]
        configs = board.multi_get([f"config/{n}" for n in firsts])
        for members, text in zip(by_digest.values(), configs, strict=True):
            for n in members:
                nodes[n]["config"] = json.loads(text)
    reach_keys = [f"reach/{n}" for n in range(num_nodes)]
    try:
        # The leaders probe after their own wait for their peers: up to two 10 s connects.
        board.wait(reach_keys, wait + timedelta(seconds=25))
        reach = {n: json.loads(r) for n, r in enumerate(board.multi_get(reach_keys))}
    except Exception:
        reach = {}
    verdict = _judge(nodes, reach)
    warning = node_warnings(nodes) if not verdict else ""
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return nodes, verdict


def _missing_ranks(missing: list[int], wait: timedelta) -> str:
    return (
        f"Rank(s) {_spans(missing)} did not reach the start of the job within "
        f"{wait.total_seconds():.0f} s (seen from rank 0): they failed before it (see "
        "their output) or cannot reach this job's rendezvous store. Fix: look at those "
        "ranks' output, start every node with the same command, or raise network.timeout_s "
        "when nodes start far apart"
    )


def _spans(numbers: list[int]) -> str:
    """`0-3, 7, 9-10`: a thousand missing ranks in one line."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _read_verdict(board: Any, wait: timedelta) -> str:
    """Blocks until rank 0 publishes (its gather, then the leaders' probes), no polling."""
    try:
        board.wait(["verdict"], 3 * wait + timedelta(seconds=30))
    except dist.DistStoreError:
        return "Rank 0 gave no verdict on the start of the job in time. Fix: see rank 0's output"
    return board.get("verdict").decode()


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


def _refuse_for_the_job(refusal: UserFacingError, world_size: int, wait: timedelta) -> None:
    """Rank 0 refused its own settings (its interface, say) before the check: it tells the
    job on the store, as the check's verdict, and leaves after every rank (launch/leaving.py).
    Left to the closed store, another node's launcher could end its worker before that
    worker said why (torchrun's agent raises on the lost store)."""
    try:
        store, _, _ = next(dist.rendezvous("env://", 0, world_size, timeout=wait))
        board = dist.PrefixStore("ddp_template/start/", store)
        remember_job_store(board, 0, world_size)
        # Node 0's entry, with no socket, releases the other leaders' wait for it at once.
        board.set("node/0", json.dumps({"node_rank": 0, "address": None, "probe_port": None}))
        board.set("verdict", f"Node 0 ({socket.gethostname()}) cannot start: {refusal}")
    except Exception:
        pass  # the refusal is still raised on this rank; the others see a closed store


def _store_gone(rank: int, endpoint: Endpoint, node_rank: int, where: str) -> NodesDisagree:
    return NodesDisagree(
        f"The job's rendezvous store at {where} closed while rank {rank} on node {node_rank} "
        f"({endpoint.hostname}) waited at the start of the job: the node that hosts it "
        "stopped. Fix: see node 0's output for why (its message names the cause)"
    )


class ProbeListener:
    """A node leader's socket on the address its backend will use, accepted by a thread so
    that every other node can connect at once (a socket nobody accepts completes only
    `backlog + 1` connects and lets the rest time out: a job of 18 nodes could not start)."""

    def __init__(self, address: str, num_nodes: int) -> None:
        self.socket: socket.socket | None = socket.socket()
        try:
            self.socket.bind((address, 0))
        except OSError:
            self.socket.close()
            self.socket = None
            self.port = None
            return
        self.port = self.socket.getsockname()[1]
        # Every node may connect to node 0 in the same instant; the kernel caps the backlog
        # at net.core.somaxconn, the thread keeps the queue short all the same.
        self.socket.listen(max(128, num_nodes))
        self.socket.settimeout(0.5)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="node-probe", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        assert self.socket is not None
        while not self._closed.is_set():
            try:
                peer, _ = self.socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            peer.close()

    def close(self) -> None:
        if self.socket is None:
            return
        self._closed.set()
        self._thread.join(timeout=2)
        self.socket.close()


def _probe_peers(peers: dict[int, Any], node_rank: int) -> list[dict]:
    """Connects to node 0's and the next node's sockets: the backend will need both."""
    failures = []
    for target, peer in sorted(peers.items()):
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


def _judge(nodes: list[dict[str, Any]], reach: dict[int, list[dict]]) -> str:
    """The verdict from the nodes' entries (each with its full config where the digests
    differed) and the leaders' probes: "" when they can train together."""
    leaders = {n["node_rank"]: n for n in nodes}
    problems = []
    refused, _ = compare_configs(leaders)
    if refused:
        shown, more, keys = _show_differences(refused, leaders)
        problems.append(
            f"The nodes of this job were started with different configs: {shown}{more}. "
            "Every node must train the same thing in the same job folder with the same "
            "software, or the ranks would silently train different models, resume from "
            "different checkpoints or wait for each other forever. Fix: " + "; ".join(_fixes(keys))
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


def node_warnings(nodes: list[dict[str, Any]]) -> str:
    """What differs between the nodes and may (each node's cores, paths read from the
    environment that name the same content, an interface's name): one line, or ""."""
    leaders = {n["node_rank"]: n for n in nodes}
    _, warned = compare_configs(leaders)
    if not warned:
        return ""
    shown, more, _ = _show_differences(warned, leaders)
    return (
        f"The nodes differ where they may: {shown}{more}. Training goes on (each node's "
        "cores, and the same content at another path, are the node's own)"
    )


def _show_differences(
    differing: list[tuple[str, dict[int, Any]]], leaders: dict[int, dict[str, Any]]
) -> tuple[str, str, list[str]]:
    # Keys that only repeat another (`seed: ${seed}` elsewhere) differ the same way:
    # named together, the key a user sets first.
    grouped: dict[str, list[str]] = {}
    values_of: dict[str, dict[int, Any]] = {}
    for key, values in differing:
        signature = json.dumps(values, sort_keys=True, default=str)
        grouped.setdefault(signature, []).append(key)
        values_of[signature] = values
    shown = "; ".join(
        ", ".join(sorted(keys, key=lambda k: (k.count("."), k)))
        + ": "
        + _values_on_nodes(values_of[sig], leaders)
        for sig, keys in list(grouped.items())[:8]
    )
    more = f" (and {len(grouped) - 8} more keys)" if len(grouped) > 8 else ""
    return shown, more, [key for keys in grouped.values() for key in keys]


def _values_on_nodes(values: dict[int, Any], leaders: dict[int, dict[str, Any]]) -> str:
    """`1 on node 0 (host0), 2 on nodes 1-31`: each distinct value once, with its nodes."""
    nodes_of: dict[str, list[int]] = {}
    for node in sorted(values):
        value = values[node]
        if isinstance(value, dict) and "per_node" in value:
            content = value.get("means")
            value = value["value"]
            text = json.dumps(value, default=str) + (
                f" (content {content['content'][:12]})" if content else ""
            )
        else:
            text = json.dumps(value, default=str)
        nodes_of.setdefault(text, []).append(node)
    parts = []
    for text, members in nodes_of.items():
        if len(members) == 1:
            parts.append(f"{text} on node {members[0]} ({leaders[members[0]]['hostname']})")
        else:
            parts.append(f"{text} on nodes {_spans(members).replace(', ', ',')}")
    return ", ".join(parts)


def _fixes(keys: list[str]) -> list[str]:
    fixes = []
    if any(key.startswith("paths.") for key in keys):
        fixes.append(
            "start every node in the same directory of a shared file system with the same "
            "job id (torchrun --rdzv_id=<job>; without it each node names its own folder)"
        )
    if any(key.startswith("software.") for key in keys):
        fixes.append(
            "install the same code and versions on every node (one container image, or "
            "the same commit and `pip install` of the same lock file)"
        )
    if any(key.startswith("environment.") for key in keys):
        fixes.append("export the same NCCL_* / GLOO_* variables on every node")
    if any(not key.startswith(("paths.", "software.", "environment.")) for key in keys):
        fixes.append("start every node with the same command and overrides")
    return fixes


def compare_configs(
    leaders: dict[int, dict[str, Any]],
) -> tuple[list[tuple[str, dict[int, Any]]], list[tuple[str, dict[int, Any]]]]:
    """(keys that must agree and differ, keys that differ where they may), each with its
    value per node. A per-node value differs where it may unless what it means differs
    (the content a path names)."""
    configs = {n: leader["config"] for n, leader in leaders.items() if "config" in leader}
    keys = sorted(set().union(*configs.values())) if configs else []
    refused: list[tuple[str, dict[int, Any]]] = []
    warned: list[tuple[str, dict[int, Any]]] = []
    for key in keys:
        if _is_node_local(key):
            continue
        values = {n: config.get(key) for n, config in configs.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) < 2:
            continue
        meanings = {json.dumps(_what_must_agree(key, v), sort_keys=True) for v in values.values()}
        (refused if len(meanings) > 1 else warned).append((key, values))
    return refused, warned


def _what_must_agree(key: str, value: Any) -> Any:
    if isinstance(value, dict) and "per_node" in value:
        return ["per node", value.get("means")]
    if MAY_DIFFER_VARIABLES.match(key):
        return ["per node"]
    return value


def flat_config(cfg: Any) -> dict[str, Any]:
    """What the nodes compare, as `dotted.key: value`: the resolved config, where a value
    that is legitimately the node's own (cores-derived, read from the environment) is a
    `{"per_node": kind, "value": ..., "means": ...}` entry compared by what it means; plus
    the software (`software.*`: this project's version and commit, torch, Lightning, CUDA)
    and the backends' environment (`environment.NCCL_*`, `environment.GLOO_*`)."""
    from omegaconf import OmegaConf

    from ddp_template.project import dotted

    resolved = dotted(OmegaConf.to_container(cfg, resolve=True))
    raw = dotted(OmegaConf.to_container(cfg, resolve=False))
    kinds = _per_node_kinds(resolved, raw)
    flat: dict[str, Any] = {}
    for key, value in resolved.items():
        kind = kinds.get(key)
        if kind is None:
            flat[key] = value
        else:
            flat[key] = {"per_node": kind, "value": value, "means": _meaning(kind, value)}
    flat.update(software_versions())
    flat.update(
        {
            f"environment.{name}": value
            for name, value in sorted(os.environ.items())
            if name.startswith(BACKEND_VARIABLE_PREFIXES)
        }
    )
    return flat


# Resolvers whose value is the node's own: its cores, or its environment.
PER_NODE_RESOLVERS = {
    "workers_per_rank": "cores",
    "slurm_cpus_per_task": "cores",
    "oc.env": "environment",
}
BACKEND_VARIABLE_PREFIXES = ("NCCL_", "GLOO_")
# Backend variables that may differ between nodes (an interface's name, a debug switch):
# shown as a warning, not refused.
MAY_DIFFER_VARIABLES = re.compile(r"^environment\.(NCCL|GLOO)_(SOCKET_IFNAME|DEBUG\w*)$")


def _per_node_kinds(resolved: dict[str, Any], raw: dict[str, Any]) -> dict[str, str]:
    """Keys whose value comes from a per-node resolver, directly or through keys that
    repeat one (`x: ${data.num_workers}`)."""
    kinds: dict[str, str] = {}
    for key, expression in raw.items():
        if key in resolved and isinstance(expression, str):
            for resolver, kind in PER_NODE_RESOLVERS.items():
                if "${" + resolver + ":" in expression:
                    kinds[key] = kind
    grew = True
    while grew:
        grew = False
        for key, expression in raw.items():
            if key in kinds or key not in resolved or not isinstance(expression, str):
                continue
            for source, kind in list(kinds.items()):
                if "${" + source + "}" in expression:
                    kinds[key] = kind
                    grew = True
                    break
    return kinds


def _meaning(kind: str, value: Any) -> Any:
    """What must agree between nodes for a per-node value: nothing for a count of cores;
    for a path read from the environment, the content it names (a data set mounted at
    another path on another node is the same data set)."""
    if kind == "cores":
        return None
    if isinstance(value, str) and value and Path(value).exists():
        return {"content": content_fingerprint(Path(value))}
    return None


def content_fingerprint(path: Path, max_entries: int = 10_000) -> str:
    """A digest of what `path` holds: a file's size and its first and last MiB, a
    folder's relative names and sizes (its first `max_entries` entries in sorted order),
    so that the same data under different mount points agree, cheaply."""
    digest = hashlib.sha256()
    if path.is_file():
        size = path.stat().st_size
        digest.update(str(size).encode())
        with path.open("rb") as handle:
            digest.update(handle.read(1 << 20))
            if size > 2 << 20:
                handle.seek(-(1 << 20), os.SEEK_END)
                digest.update(handle.read(1 << 20))
        return digest.hexdigest()
    entries = 0
    for folder, subfolders, files in os.walk(path):
        subfolders.sort()
        for name in sorted(files):
            full = Path(folder, name)
            with contextlib.suppress(OSError):
                digest.update(f"{full.relative_to(path)}:{full.stat().st_size}\n".encode())
            entries += 1
            if entries >= max_entries:
                return digest.hexdigest()
    return digest.hexdigest()


def software_versions() -> dict[str, str]:
    """What every node must run alike: this project (version and git commit), torch,
    Lightning and the CUDA torch was built for."""
    import lightning
    import torch

    try:
        version = importlib.metadata.version("ddp-template")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "software.ddp_template": version,
        "software.ddp_template_commit": _git_commit(Path(__file__).resolve().parents[1])
        or "not a git checkout",
        "software.torch": torch.__version__,
        "software.lightning": lightning.__version__,
        "software.cuda": str(torch.version.cuda),
    }


def _git_commit(folder: Path) -> str | None:
    """The commit of the checkout the code runs from, `+changes` when it has edits."""
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no", "."],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+changes" if dirty else "")


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
        start_checked_process_group(self, self.node_config)
        super().setup_distributed()
        if self._start_method == "spawn":
            # Lightning's spawned workers return from `fit` and `test` with the group
            # alive; a torchrun or popen worker leaves it at the end of train.py, and on
            # an error keeps the interpreter's own way out.
            leave_process_group_at_exit()


def start_checked_process_group(strategy: Any, node_config: dict[str, Any]) -> None:
    """The nodes' checks, then the process group, for a Lightning strategy of a job of
    several nodes (`ddp`'s and `fsdp`'s); Lightning's own start then leaves the existing
    process group as it is. One node needs none: its processes share one config."""
    if strategy.num_nodes <= 1 or dist.is_initialized():
        return
    reset_seed()
    strategy.set_world_ranks()
    env = strategy.cluster_environment
    assert env is not None
    start_process_group(
        node_config,
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        node_rank=strategy.node_rank,
        local_rank=strategy.local_rank,
        num_nodes=strategy.num_nodes,
        main_address=env.main_address,
        main_port=env.main_port,
        backend=strategy._get_process_group_backend(),
        timeout=strategy._timeout or default_pg_timeout,
        device_id=strategy.root_device if strategy.root_device.type != "cpu" else None,
    )


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
