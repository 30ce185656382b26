"""Which address and interface a rank's backend uses to reach the other nodes.

gloo and NCCL bind to the address of the interface named by GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME, or else to what the machine's own hostname resolves to. On many
machines that is a loopback address (`127.0.0.1 myhost` in /etc/hosts, or Debian's and
Ubuntu's `127.0.1.1 myhost`): the other nodes are then told to connect to 127.0.x.x, which
is themselves, and the job fails with `connectFullMesh failed ... remote=[127.0.1.1]` or
hangs silently. So before the process group of a job of several nodes starts, every rank
picks the interface that reaches the rendezvous host (or the one the user named with
`network.interface` or the variables above) and sets both variables to it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from ddp_template.errors import ConfigError

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Endpoint:
    """What one rank's backend will use: shown per node in the start-up report."""

    hostname: str
    address: str
    interface: str
    # Why this interface: the variable or switch that named it, or the route that chose it.
    chosen_by: str


def interfaces() -> dict[str, list[str]]:
    """This machine's up interfaces and their IPv4 addresses."""
    import psutil

    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    found: dict[str, list[str]] = {}
    for name, addresses in psutil.net_if_addrs().items():
        ipv4 = [a.address for a in addresses if a.family == socket.AF_INET]
        if name in up and ipv4:
            found[name] = ipv4
    return found


def resolve(name: str) -> list[str]:
    """The IPv4 addresses a host name (or address) resolves to on this machine."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None, socket.AF_INET)})
    except (socket.gaierror, UnicodeError):
        return []


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def route_source(address: str) -> str | None:
    """The local address the kernel sends from to reach `address` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError:
            return None
        return probe.getsockname()[0]


def choose_endpoint(
    master_addr: str,
    node_rank: int,
    num_nodes: int,
    interface: str | None = None,
    master_port: int | None = None,
) -> Endpoint:
    """The interface and address this rank's backend should use, or a ConfigError that
    names the address, the node and the fix. `interface` is `network.interface`."""
    hostname = socket.gethostname()
    table = interfaces()
    named, by = _named_interface(interface)
    if named is not None:
        if named not in table:
            raise ConfigError(
                by,
                named,
                f"an interface of node {node_rank} ({hostname}) that is up and has an IPv4 "
                f"address: {_describe(table)}",
                f"{by}=<one of {', '.join(sorted(table))}>, or leave it unset: the template "
                "then takes the interface that reaches the rendezvous host",
            )
        return Endpoint(hostname, table[named][0], named, by)

    masters = resolve(master_addr)
    if not masters:
        raise ConfigError(
            "MASTER_ADDR",
            master_addr,
            f"a host name that resolves on node {node_rank} ({hostname}); it does not",
            f"add {master_addr} to /etc/hosts or DNS on every node, or give the launcher the "
            "rendezvous host's IP address instead of its name",
        )
    remote = [a for a in masters if not is_loopback(a)]
    if remote:
        source = route_source(remote[0])
        name = _owner(source, table) if source else None
        if name is None:
            raise ConfigError(
                "MASTER_ADDR",
                master_addr,
                f"an address node {node_rank} ({hostname}) can route to; {remote[0]} is not "
                f"reachable from any of its interfaces ({_describe(table)})",
                "check the address, or name the interface with network.interface=<name>",
            )
        return Endpoint(hostname, str(source), name, f"route to {master_addr} ({remote[0]})")

    # The rendezvous host's name resolves to a loopback address here.
    if node_rank != 0 and master_port is not None and _answers(masters[0], master_port):
        # Node 0 runs on this very machine (several "nodes" on one host, over loopback).
        return Endpoint(
            hostname, masters[0], _owner(masters[0], table) or "lo", "node 0 is on this machine"
        )
    if node_rank != 0:
        raise ConfigError(
            "MASTER_ADDR",
            master_addr,
            f"the address of node 0 as node {node_rank} ({hostname}) sees it; here "
            f"{master_addr} resolves to {masters[0]}, a loopback address, which is node "
            f"{node_rank} itself: its ranks would wait for node 0 on their own machine",
            f"make {master_addr} resolve to node 0's network address on every node (/etc/hosts "
            "or DNS), or start the launcher with the rendezvous host's IP address "
            "(torchrun --rdzv_endpoint=<IP>:<port>)",
        )
    outward = _outward_interface(table)
    if outward is None:
        raise ConfigError(
            "MASTER_ADDR",
            master_addr,
            f"an address the other nodes can reach; on node 0 ({hostname}) it resolves to "
            f"{masters[0]} and the node has no interface besides loopback ({_describe(table)})",
            "connect the node to the others' network, or name the interface with "
            "network.interface=<name>",
        )
    name, how = outward
    return Endpoint(hostname, table[name][0], name, how)


def _answers(address: str, port: int, within_s: float = 10.0) -> bool:
    """Whether something listens at address:port within `within_s` (node 0's store may
    still be starting)."""
    import time

    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def use_endpoint(endpoint: Endpoint) -> None:
    """Makes gloo and NCCL bind to the chosen interface (a value the user set is kept)."""
    for variable in IFNAME_VARIABLES:
        os.environ.setdefault(variable, endpoint.interface)


def _named_interface(interface: str | None) -> tuple[str | None, str]:
    if interface:
        return interface, "network.interface"
    for variable in IFNAME_VARIABLES:
        value = os.environ.get(variable, "")
        # NCCL also takes prefixes and exclusions (`eth`, `^docker`): only a plain name
        # can be checked here.
        if value and not any(mark in value for mark in "^=,"):
            return value, variable
    return None, ""


def _owner(address: str, table: dict[str, list[str]]) -> str | None:
    for name, addresses in table.items():
        if address in addresses:
            return name
    return None


def _outward_interface(table: dict[str, list[str]]) -> tuple[str, str] | None:
    """On the rendezvous host itself: the interface of the default route, else the only
    interface that is not loopback."""
    default = _default_route_interface()
    if default in table:
        return default, "the default route"
    outward = [n for n, addrs in table.items() if not all(is_loopback(a) for a in addrs)]
    if len(outward) == 1:
        return outward[0], "the only interface besides loopback"
    return None


def _default_route_interface() -> str | None:
    try:
        with open("/proc/net/route") as routes:
            for line in routes.readlines()[1:]:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def _describe(table: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} {'/'.join(addrs)}" for name, addrs in sorted(table.items())) or "none"


def check_rendezvous_host(
    master_addr: str, port: int, node_rank: int, timeout_s: float
) -> Endpoint:
    """For this project's own agent on several nodes, before any worker starts: node 0
    must own `master_addr` (it hosts the rendezvous there); every other node must reach
    node 0's port within `timeout_s` (a refused connection is a node 0 not started yet and
    is retried; nothing answering at all is named). Returns this node's endpoint."""
    import time

    hostname = socket.gethostname()
    table = interfaces()
    key = "network.master_addr"
    addresses = resolve(master_addr)
    if not addresses:
        raise ConfigError(
            key,
            master_addr,
            f"a name or address that resolves on node {node_rank} ({hostname}); it does not",
            "give node 0's IP address, or add its name to /etc/hosts or DNS on every node",
        )
    if node_rank == 0:
        own = {a for addrs in table.values() for a in addrs}
        if not any(a in own and not is_loopback(a) for a in addresses):
            raise ConfigError(
                key,
                master_addr,
                f"an address of node 0, the machine that hosts the rendezvous (here "
                f"{hostname}: {_describe(table)}); {master_addr} resolves to "
                f"{', '.join(addresses)}",
                "give this machine's network address (or a hostname that resolves to it) "
                "on every node, or start this machine with its own network.node_rank",
            )
        return choose_endpoint(master_addr, 0, 2)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addresses[0], port), timeout=3).close()
            return choose_endpoint(master_addr, node_rank, 2)
        except ConnectionRefusedError:
            last = "connection refused: nothing listens there yet"
        except OSError as err:
            last = str(err) or type(err).__name__
        time.sleep(1)
    raise ConfigError(
        key,
        master_addr,
        f"node 0's address as node {node_rank} ({hostname}) reaches it; {addresses[0]}:{port} "
        f"did not answer within {timeout_s:g} s ({last})",
        "start node 0 (network.node_rank=0) with the same network.master_port, check that "
        f"{master_addr} is node 0's address and that port {port} is open between the nodes "
        "(network.timeout_s waits longer)",
    )
