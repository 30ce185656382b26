"""A multi-node lab on one machine: N "nodes", each a network namespace with its own
hostname, address, hosts file and CPU cores, joined through a switch by links of a chosen
rate, so that multi-node jobs meet what real nodes have (another address, another
interface, a link that costs time) instead of `127.0.0.1`.

    python -m ddp_template.tools.netlab up --nodes 2 --rate 1gbit      # idempotent
    python -m ddp_template.tools.netlab run 1 -- torchrun ... train.py   # a command on node 1
    python -m ddp_template.tools.netlab probe                            # the link's real rate
    python -m ddp_template.tools.netlab down

Layout (root only; Linux network namespaces, iproute2's `ip` and `tc`):
  <prefix>-sw        a namespace with a bridge: the switch, nothing else runs there
  <prefix>-node<i>   node i: `eth0` = 10.213.<subnet>.<10+i>/24, hostname node<i>
                     (or <prefix>-node<i> names when several labs exist at once)
Each node's `eth0` and its switch port shape their egress with a token bucket (`tc tbf`),
so a node sends and receives at the link rate. The links carry jumbo frames (MTU 9000, as
cluster data networks do; `--mtu`): at 1500 bytes the shaped link hands the receiver one
small packet at a time, and each wake-up costs CPU that a real NIC's interrupt coalescing
and receive offload do not (docs/nodes.md, "The lab's MTU"). Names resolve through
/etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts: every hostname
maps to its link address, or, to reproduce a common misconfiguration, a node's own name to
a loopback address (`--own-hostname loopback|debian`). A command on a node runs pinned to
that node's cores, optionally with a private disk (a tmpfs over a folder, in its own mount
namespace), as nodes without a shared file system have. Traffic never leaves the lab's
namespaces: its addresses exist nowhere else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ddp_template.errors import ConfigError, UserFacingError

STATE_DIR = Path("/run/ddp-template-netlab")
NETNS_ETC = Path("/etc/netns")
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
# Node i's address is 10.213.<lab>.<FIRST_HOST + i>, within one /24.
FIRST_HOST = 10
MAX_NODES = 254 - FIRST_HOST + 1
# What one node of the lab itself holds (namespaces, veth pair, tbf queues), measured with
# the lab's nodes idle: small beside any process a node runs (docs/nodes.md).
LAB_MEMORY_PER_NODE_MB = 1
# tc's rate units, in bits per second.
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
RATE_FORMAT = "a number and a unit of bits per second (e.g. 200mbit, 1gbit, 2.5gbit), or none"
# A node's cpu quota is enforced per period: a node of fraction f runs f x period, then waits
# up to (1 - f) x period. cgroup v1 takes periods of 1 ms to 1 s and no quota under 1 ms.
DEFAULT_CPU_PERIOD_US = 100_000
CPU_PERIOD_RANGE_US = (1_000, 1_000_000)
MIN_CPU_QUOTA_US = 1_000
# Jumbo frames, as a cluster's data network runs them; veth takes up to 65535.
DEFAULT_MTU = 9000
MTU_RANGE = (576, 65535)
OWN_HOSTNAME = {
    "link": "every hostname resolves to its node's link address (a cluster set up right)",
    "loopback": "a node's own hostname resolves to 127.0.0.1 (as this machine's /etc/hosts)",
    "debian": "a node's own hostname resolves to 127.0.1.1 (Debian's and Ubuntu's default)",
}


def parse_rate(text: str | None) -> int | None:
    """Bits per second of a tc rate such as `200mbit` or `1gbit`; None for an unshaped link."""
    if text is None or str(text).lower() in ("none", "unlimited", ""):
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError("--rate", text, RATE_FORMAT, "e.g. --rate 1gbit or --rate 200mbit")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_rate(bits_per_s: int | None) -> str:
    if bits_per_s is None:
        return "unshaped"
    for unit in ("gbit", "mbit", "kbit"):
        if bits_per_s >= _UNITS[unit]:
            return f"{bits_per_s / _UNITS[unit]:.4g}{unit}"
    return f"{bits_per_s}bit"


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    hostname: str
    address: str
    cores: tuple[int, ...]
    interface: str = "eth0"
    # The node's cgroup v1 cpu group (CPU_CGROUPS/<name>) when it has a cpu quota.
    cgroup: str | None = None


@dataclass
class Lab:
    prefix: str
    nodes: list[Node]
    rate_bps: int | None
    own_hostname: str = "link"
    subnet: int = 0
    # The share of one core each node may use (a cgroup cpu quota), or None: no quota.
    cpu_fraction: float | None = None
    # Every link's MTU in bytes (both ends of each veth pair; the bridge follows its ports).
    mtu: int = DEFAULT_MTU
    # The period of each node's cpu quota (with cpu_fraction), in microseconds.
    cpu_period_us: int = DEFAULT_CPU_PERIOD_US

    # --- building and removing ---------------------------------------------------------

    @classmethod
    def up(
        cls,
        nodes: int = 2,
        rate: str | None = "1gbit",
        prefix: str = "ddplab",
        own_hostname: str = "link",
        cores_per_node: int | None = None,
        cpu_fraction: float | str | None = None,
        memory_per_node_mb: float = 0,
        mtu: int = DEFAULT_MTU,
        cpu_period_us: int = DEFAULT_CPU_PERIOD_US,
    ) -> Lab:
        """Builds the lab, or returns the running one when it has this shape (a new rate is
        applied in place). Needs root and network namespaces. `cpu_fraction` gives each
        node that share of one core (a cgroup cpu quota; "auto": the machine's cores
        divided among the nodes); `memory_per_node_mb` is what each node will run, so that
        a lab the machine cannot hold is refused before anything is built. `mtu`: every
        link's MTU in bytes. `cpu_period_us`: the period over which the quota holds (a
        throttled node waits up to (1 - fraction) x period)."""
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 2:
            raise ConfigError("--nodes", nodes, "an integer >= 2", "e.g. --nodes 2")
        low, high = MTU_RANGE
        if not isinstance(mtu, int) or isinstance(mtu, bool) or not low <= mtu <= high:
            raise ConfigError(
                "--mtu",
                mtu,
                f"an integer from {low} to {high} (bytes; 1500: plain Ethernet, 9000: jumbo "
                "frames)",
                f"e.g. --mtu {DEFAULT_MTU}",
            )
        fraction = plan_capacity(nodes, cpu_fraction, memory_per_node_mb)
        check_cpu_period(cpu_period_us, fraction)
        if own_hostname not in OWN_HOSTNAME:
            raise ConfigError(
                "--own-hostname", own_hostname, _choices(OWN_HOSTNAME), "--own-hostname link"
            )
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", prefix):
            raise ConfigError(
                "--prefix",
                prefix,
                "1-10 lower-case letters and digits, starting with a letter",
                "e.g. --prefix ddplab",
            )
        rate_bps = parse_rate(rate)
        require_namespaces()
        existing = cls.load(prefix)
        if (
            existing
            and len(existing.nodes) == nodes
            and existing.own_hostname == own_hostname
            and existing.cpu_fraction == fraction
            and existing.mtu == mtu
            and existing.cpu_period_us == cpu_period_us
        ):
            existing.set_rate(rate_bps)
            return existing
        if existing:
            existing.down()
        lab = cls(
            prefix,
            _plan_nodes(prefix, nodes, None if fraction else cores_per_node, fraction),
            rate_bps,
            own_hostname,
            _subnet_for(prefix),
            fraction,
            mtu,
            cpu_period_us,
        )
        lab.nodes = [
            replace(n, address=f"10.213.{lab.subnet}.{FIRST_HOST + n.index}") for n in lab.nodes
        ]
        try:
            lab._build()
        except BaseException:
            lab.down()
            raise
        return lab

    def _build(self) -> None:
        # State first: a build that fails half-way is removed by `down`, cgroups included.
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps(asdict(self), indent=2))
        for node in self.nodes:
            if node.cgroup is not None:
                _make_cpu_cgroup(node.cgroup, self.cpu_fraction or 1.0, self.cpu_period_us)
        switch = self.switch
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "lo", "up")
        for node in self.nodes:
            port = f"p{node.index}"
            _ip("netns", "add", node.namespace)
            _ip(
                "-n",
                switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                node.interface,
                "netns",
                node.namespace,
            )
            _ip("-n", switch, "link", "set", port, "mtu", str(self.mtu))
            _ip("-n", node.namespace, "link", "set", node.interface, "mtu", str(self.mtu))
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            self._write_hosts(node)
        _ip("-n", switch, "link", "set", "br0", "up")
        self.set_rate(self.rate_bps, force=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps(asdict(self), indent=2))

    def set_rate(self, rate_bps: int | None, force: bool = False) -> None:
        """Shapes every link (both directions) to `rate_bps`, or removes the shaping."""
        if rate_bps == self.rate_bps and not force:
            return
        for node in self.nodes:
            for namespace, device in (
                (node.namespace, node.interface),
                (self.switch, f"p{node.index}"),
            ):
                if rate_bps is None:
                    subprocess.run(
                        ["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"],
                        capture_output=True,
                    )
                    continue
                # A burst of ~2 ms of traffic (at least 32 KiB and two frames): the sustained
                # rate is the rate, without starving small messages.
                burst = max(32 * 1024, rate_bps // 8 // 500, 2 * (self.mtu + 64))
                _run(
                    [
                        "tc",
                        "-n",
                        namespace,
                        "qdisc",
                        "replace",
                        "dev",
                        device,
                        "root",
                        "tbf",
                        "rate",
                        f"{rate_bps}bit",
                        "burst",
                        str(burst),
                        "latency",
                        "50ms",
                    ]
                )
        self.rate_bps = rate_bps
        if self._state_file().parent.is_dir():
            self._state_file().write_text(json.dumps(asdict(self), indent=2))

    def down(self) -> None:
        """Removes every namespace, hosts file and state of this lab (also of a half-built one)."""
        for namespace in [n.namespace for n in self.nodes] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        for node in self.nodes:
            if node.cgroup is not None:
                _remove_cpu_cgroup(node.cgroup)
        self._state_file().unlink(missing_ok=True)

    @classmethod
    def load(cls, prefix: str = "ddplab") -> Lab | None:
        state = STATE_DIR / f"{prefix}.json"
        if not state.is_file():
            return None
        raw = json.loads(state.read_text())
        raw["nodes"] = [Node(**{**n, "cores": tuple(n["cores"])}) for n in raw["nodes"]]
        raw.setdefault("cpu_fraction", None)
        raw.setdefault("mtu", 1500)
        raw.setdefault("cpu_period_us", DEFAULT_CPU_PERIOD_US)
        return cls(**raw)

    # --- using it ------------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def command(
        self, index: int, args: Sequence[str], private_disk: str | Path | None = None
    ) -> list[str]:
        """The command line that runs `args` on node `index`: inside its network namespace,
        with its hostname, on its cores, and with a tmpfs over `private_disk` if given."""
        node = self.node(index)
        script = 'hostname "$0"; '
        unshare = ["unshare", "--uts"]
        if private_disk is not None:
            unshare += ["--mount", "--propagation", "private"]
            script += (
                f'mkdir -p "{private_disk}" && mount -t tmpfs none "{private_disk}" || exit 97; '
            )
        if node.cgroup is not None:
            script += _cgroup_view_script()
        cores = ",".join(str(c) for c in node.cores)
        script += f'exec taskset -c {cores} "$@"'
        command = [
            "ip",
            "netns",
            "exec",
            node.namespace,
            "env",
            f"PATH={_path_with_this_environment()}",
            *unshare,
            "sh",
            "-c",
            script,
            node.hostname,
            *args,
        ]
        if node.cgroup is None:
            return command
        # Joined before `ip netns exec`, which mounts a /sys without the cgroup tree.
        joins = f'echo $$ > "{CPU_CGROUPS / node.cgroup}/cgroup.procs" || exit 96; exec "$@"'
        return ["sh", "-c", joins, "cgroup", *command]

    def popen(
        self,
        index: int,
        args: Sequence[str],
        private_disk: str | Path | None = None,
        **popen: object,
    ) -> subprocess.Popen:
        return subprocess.Popen(self.command(index, args, private_disk), **popen)  # type: ignore[call-overload]

    def node(self, index: int) -> Node:
        if not 0 <= index < len(self.nodes):
            raise ConfigError(
                "node",
                index,
                f"a node of this lab: 0..{len(self.nodes) - 1}",
                "give a node index from `netlab status`",
            )
        return self.nodes[index]

    def probe(
        self, megabytes: int = 20, sender: int = 1, receiver: int = 0, repeats: int = 3
    ) -> float:
        """The link's real rate in bit/s: the median of `repeats` readings (`probe_readings`)."""
        return statistics.median(self.probe_readings(megabytes, sender, receiver, repeats))

    def probe_readings(
        self, megabytes: int = 20, sender: int = 1, receiver: int = 0, repeats: int = 3
    ) -> list[float]:
        """One reading per repeat, in bit/s, each a fresh TCP transfer of `megabytes`: one
        reading alone read 260 and 960 Mbit/s on the same 1 Gbit/s link (cores busy with
        other work), so the spread is part of the answer."""
        return [self._probe_once(megabytes, sender, receiver) for _ in range(repeats)]

    def _probe_once(self, megabytes: int, sender: int, receiver: int) -> float:
        port = 5999
        server = self.popen(
            receiver,
            [sys.executable, "-c", _PROBE_SERVER, str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            target = self.node(receiver).address
            code = _PROBE_CLIENT.format(host=target, port=port, megabytes=megabytes)
            self.popen(sender, [sys.executable, "-c", code]).wait(timeout=120)
            out, _ = server.communicate(timeout=60)
        finally:
            server.kill()
        return float(out.strip())

    def allreduce_probe(self, megabytes: float = 16, port: int = 29899) -> dict:
        """A short gloo all-reduce between all nodes (`ddp_template.tools.allreduce_probe`): the
        latency per hop and the effective bandwidth per dtype, as rank 0 measured them."""
        master = f"{self.nodes[0].address}:{port}"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.nodes[0].interface}
        procs = [
            self.popen(
                n.index,
                [
                    sys.executable,
                    "-m",
                    "ddp_template.tools.allreduce_probe",
                    "--rank",
                    str(n.index),
                    "--world",
                    str(len(self.nodes)),
                    "--master",
                    master,
                    "--megabytes",
                    str(megabytes),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for n in self.nodes
        ]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise UserFacingError(
                f"The all-reduce probe failed on the lab {self.prefix}. Fix: check `netlab status`"
            )
        measured = json.loads(outputs[0].strip().splitlines()[-1])
        measured["warnings"] = allreduce_warnings(measured, self.rate_bps)
        return measured

    def _write_hosts(self, node: Node) -> None:
        lines = ["127.0.0.1 localhost"]
        if self.own_hostname == "loopback":
            lines[0] += f" {node.hostname}"
        elif self.own_hostname == "debian":
            lines.append(f"127.0.1.1 {node.hostname}")
        for other in self.nodes:
            if other is not node or self.own_hostname == "link":
                lines.append(f"{other.address} {other.hostname}")
        folder = NETNS_ETC / node.namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def _state_file(self) -> Path:
        return STATE_DIR / f"{self.prefix}.json"

    def describe(self) -> str:
        rows = [
            f"lab {self.prefix}: {len(self.nodes)} nodes, links {format_rate(self.rate_bps)} (MTU {self.mtu}), own hostname: {OWN_HOSTNAME[self.own_hostname]}"
            + (
                f", {self.cpu_fraction:.3g} of a core per node (cgroup cpu quota, period "
                f"{self.cpu_period_us / 1000:g} ms)"
                if self.cpu_fraction
                else ""
            )
        ]
        for n in self.nodes:
            rows.append(
                f"  node {n.index}: hostname {n.hostname}, {n.interface} {n.address}, namespace {n.namespace}, cores {','.join(map(str, n.cores))}"
            )
        return "\n".join(rows)


# Readings of one probe that differ by more than this fraction of their median, or a median
# below this fraction of the shaped rate (tbf holds a little under the rate), get a warning.
SPREAD_BOUND = 0.25
BELOW_RATE_BOUND = 0.7
# Latency readings: the slowest more than this many times the median.
LATENCY_SPREAD_BOUND = 4.0


def rate_warnings(what: str, readings: Sequence[float], rate_bps: int | None) -> list[str]:
    """One line per doubt about `readings` (bit/s) of a link shaped to `rate_bps`."""
    middle = statistics.median(readings)
    lines = []
    if len(readings) > 1 and (max(readings) - min(readings)) > SPREAD_BOUND * middle:
        lines.append(
            f"warning: the {what} readings disagree ({_span(readings)} over {len(readings)} "
            f"readings, more than {SPREAD_BOUND:.0%} of their median): the cores or the link "
            "were busy with other work; measure again on a quieter machine"
        )
    if rate_bps is not None and middle < BELOW_RATE_BOUND * rate_bps:
        lines.append(
            f"warning: the {what} median {format_rate(int(middle))} is below "
            f"{BELOW_RATE_BOUND:.0%} of the {format_rate(rate_bps)} the links are shaped to: "
            "the nodes' cores, not the link, set the pace (busy cores, or too few per node)"
        )
    return lines


def allreduce_warnings(measured: dict, rate_bps: int | None) -> list[str]:
    """Doubts about an all-reduce probe's result (`ddp_template.tools.allreduce_probe`)."""
    lines = rate_warnings(
        "all-reduce float32",
        measured.get("bandwidth_readings_bps", {}).get("float32", [])
        or [measured["bandwidth_bps"]["float32"]],
        rate_bps,
    )
    latencies = measured.get("latency_readings_s") or [measured["latency_s"]]
    if max(latencies) > LATENCY_SPREAD_BOUND * statistics.median(latencies):
        lines.append(
            f"warning: the latency per hop read {min(latencies) * 1e6:,.0f} to "
            f"{max(latencies) * 1e6:,.0f} us (median {statistics.median(latencies) * 1e6:,.0f}): "
            "the slowest readings waited for busy cores; the median is used"
        )
    return lines


def ladder_line(measured: dict) -> str:
    """The probe's float32 all-reduces by size beside the scaling model's time for each
    (the longer of the bytes' time and the hops' waits, as `scaling.Link.transfer_s`
    counts it; not imported from there: scaling imports this module) and the two added up."""
    world = int(measured["world"])
    hops, ring = 2 * (world - 1), 2 * (world - 1) / world
    latency, bandwidth = float(measured["latency_s"]), float(measured["bandwidth_bps"]["float32"])
    cells = []
    for nbytes, seconds in measured.get("float32_seconds_by_bytes", []):
        wire, waits = ring * nbytes * 8 / bandwidth, hops * latency
        cells.append(
            f"{_bytes(nbytes)} {seconds * 1e3:,.1f} ms (model {max(wire, waits) * 1e3:,.1f}, "
            f"sum {(wire + waits) * 1e3:,.1f})"
        )
    return "all-reduce float32 by size: " + ("; ".join(cells) or "not measured")


def _bytes(nbytes: float) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def _span(readings: Sequence[float]) -> str:
    return f"{format_rate(int(min(readings)))} to {format_rate(int(max(readings)))}"


_PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(60)
c, _ = s.accept(); n = 0; start = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    start = start or time.perf_counter(); n += len(b)
print(n * 8 / (time.perf_counter() - start))
"""
_PROBE_CLIENT = """
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(("{host}", {port}), timeout=5); break
    except ConnectionRefusedError:
        time.sleep(0.05)
buf = b"x" * (1 << 20)
for _ in range({megabytes}): c.sendall(buf)
c.close()
"""


def _path_with_this_environment() -> str:
    """PATH with the running interpreter's folder first: a command on a node (`torchrun`,
    `python`) is then the one of this environment (a virtual environment's bin/ is on no
    PATH unless activated; taskset would not find `torchrun` otherwise)."""
    here = str(Path(sys.executable).parent)
    rest = [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if p and p != here]
    return os.pathsep.join([here, *rest])


def require_namespaces() -> None:
    """Stops with the reason when this machine cannot make the lab."""
    missing = [tool for tool in ("ip", "tc", "unshare", "taskset") if shutil.which(tool) is None]
    if missing:
        raise UserFacingError(
            f"The lab needs {', '.join(missing)} (iproute2, util-linux). Fix: apt-get install iproute2 util-linux"
        )
    if os.geteuid() != 0:
        raise UserFacingError(
            "The lab makes network namespaces, which needs root. Fix: run it as root (sudo)"
        )
    probe = f"ddpprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        raise UserFacingError(
            f"This machine cannot make network namespaces: {made.stderr.strip()}. Fix: run on a Linux host or a privileged container"
        )


def _plan_nodes(
    prefix: str, count: int, cores_per_node: int | None, cpu_fraction: float | None = None
) -> list[Node]:
    """Node i gets its own block of cores when there are enough (so a node computes as fast
    as a one-node run on the same cores); with more nodes than cores they share. With a
    cpu fraction, every node may run on every core and its cgroup's quota bounds its share
    (a pinned core would let a fraction of 1/4 wait behind its neighbours)."""
    cores = sorted(os.sched_getaffinity(0))
    per_node = len(cores) if cpu_fraction else cores_per_node or max(1, len(cores) // count)
    nodes = []
    for i in range(count):
        first = (i * per_node) % len(cores)
        mine = tuple(cores[(first + k) % len(cores)] for k in range(min(per_node, len(cores))))
        hostname = f"node{i}" if prefix == "ddplab" else f"{prefix}-node{i}"
        cgroup = f"{prefix}-node{i}" if cpu_fraction else None
        nodes.append(Node(i, f"{prefix}-node{i}", hostname, "", mine, cgroup=cgroup))
    return nodes


def plan_capacity(
    nodes: int, cpu_fraction: float | str | None, memory_per_node_mb: float
) -> float | None:
    """The cpu fraction per node, after refusing a lab this machine cannot hold: more
    nodes than the lab's /24 has addresses, quotas that add up to more than the cores,
    or more memory than is available now. Nothing is built before this passes."""
    cores = len(os.sched_getaffinity(0))
    if nodes > MAX_NODES:
        raise ConfigError(
            "--nodes",
            nodes,
            f"at most {MAX_NODES} nodes: each lab is one /24 of addresses "
            f"(10.213.<lab>.{FIRST_HOST}-254)",
            f"ask for --nodes {MAX_NODES} or fewer",
        )
    fraction: float | None
    if cpu_fraction in (None, "none", ""):
        fraction = None
    elif cpu_fraction == "auto":
        fraction = cores / nodes
    else:
        try:
            fraction = float(cpu_fraction)
        except (TypeError, ValueError):
            fraction = -1.0
        if not 0.01 <= fraction <= cores:
            raise ConfigError(
                "--cpu-fraction",
                cpu_fraction,
                f"a share of one core between 0.01 and {cores} (this machine's cores), "
                "auto (the cores divided among the nodes) or none",
                "e.g. --cpu-fraction 0.25 or --cpu-fraction auto",
            )
    if fraction is not None:
        if not CPU_CGROUPS.is_dir() or not (CPU_CGROUPS / "cpu.cfs_quota_us").is_file():
            raise UserFacingError(
                f"A cpu fraction per node needs cgroup v1's cpu controller at {CPU_CGROUPS} "
                "(cpu.cfs_quota_us), which this machine does not have. Fix: leave out "
                "--cpu-fraction (nodes then share the cores) or run on a host with it"
            )
        if fraction * nodes > cores * (1 + 1e-9):
            raise ConfigError(
                "--cpu-fraction",
                cpu_fraction,
                f"at most {cores / nodes:.3g} of a core for {nodes} nodes: the quotas must "
                f"add up to no more than this machine's {cores} cores, or a node would get "
                "less than its share and the timing would not be the fraction asked",
                f"ask for --cpu-fraction {cores / nodes:.3g} (or auto), or fewer nodes",
            )
    available = _available_memory_mb()
    needed = nodes * (memory_per_node_mb + LAB_MEMORY_PER_NODE_MB)
    if available is not None and needed > available:
        raise ConfigError(
            "--memory-per-node",
            memory_per_node_mb,
            f"at most {available / nodes - LAB_MEMORY_PER_NODE_MB:.0f} MiB per node for "
            f"{nodes} nodes: {nodes} x {memory_per_node_mb + LAB_MEMORY_PER_NODE_MB:.0f} MiB "
            f"is more than the {available:.0f} MiB available now",
            "ask for fewer nodes, run less on each (e.g. one worker per node), or wait for "
            "the machine's other jobs",
        )
    return fraction


def _available_memory_mb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _cgroup_view_script() -> str:
    """Shell that mounts the cpu cgroup tree inside a node, as a container sees its own: the
    /sys that `ip netns exec` mounts has none, and without it a node's processes could not
    read their quota (`launch.topology.available_cores`) and would start a thread per core
    of the machine, unlike a one-node run pinned to its core. The mount stays inside the
    node's mount namespace."""
    tree = CPU_CGROUPS.resolve()  # e.g. /sys/fs/cgroup/cpu,cpuacct on some machines
    script = (
        f"mount -t tmpfs none {tree.parent} && mkdir {tree} && "
        f"mount -t cgroup -o {tree.name} none {tree}"
    )
    if tree != CPU_CGROUPS:
        script += f" && ln -s {tree.name} {CPU_CGROUPS}"
    return f"{{ {script}; }} || exit 95; "


def check_cpu_period(period_us: object, fraction: float | None) -> None:
    """A quota period cgroup v1 takes, long enough to hold `fraction` (a quota of at least
    1 ms), before anything is built."""
    low, high = CPU_PERIOD_RANGE_US
    if (
        not isinstance(period_us, int)
        or isinstance(period_us, bool)
        or not low <= period_us <= high
    ):
        raise ConfigError(
            "--cpu-period-us",
            period_us,
            f"an integer from {low} to {high} (microseconds, cgroup v1's range)",
            f"e.g. --cpu-period-us {DEFAULT_CPU_PERIOD_US}",
        )
    if fraction and fraction * period_us < MIN_CPU_QUOTA_US:
        shortest = math.ceil(MIN_CPU_QUOTA_US / fraction)
        raise ConfigError(
            "--cpu-period-us",
            period_us,
            f"a period that holds {fraction:g} of a core: cgroup v1 takes no quota under "
            f"{MIN_CPU_QUOTA_US} us, so at least {shortest}",
            f"e.g. --cpu-period-us {shortest}",
        )


def _make_cpu_cgroup(name: str, fraction: float, period_us: int) -> None:
    folder = CPU_CGROUPS / name
    folder.mkdir(exist_ok=True)
    # The period first: the quota is a share of it.
    (folder / "cpu.cfs_period_us").write_text(str(period_us))
    (folder / "cpu.cfs_quota_us").write_text(str(round(fraction * period_us)))


def _remove_cpu_cgroup(name: str) -> None:
    """Removes the node's cgroup; a process still in it (a node's command left running)
    goes back to the root group first, so that nothing of the lab stays behind."""
    folder = CPU_CGROUPS / name
    if not folder.is_dir():
        return
    try:
        for pid in (folder / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # it ended meanwhile
                (CPU_CGROUPS / "cgroup.procs").write_text(pid)
        folder.rmdir()
    except OSError:
        pass


def _subnet_for(prefix: str) -> int:
    """A /24 per lab, so that labs side by side never share addresses."""
    return sum(prefix.encode()) % 200 + 1


def _choices(options: dict[str, str]) -> str:
    return "one of " + "; ".join(f"{k} ({v})" for k, v in options.items())


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserFacingError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.tools.netlab", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build the lab (or reshape the running one)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--rate", default="1gbit", help=RATE_FORMAT)
    up.add_argument("--own-hostname", default="link", choices=list(OWN_HOSTNAME))
    up.add_argument("--cores-per-node", type=int, default=None)
    up.add_argument(
        "--cpu-fraction",
        default=None,
        help="each node's share of one core, a cgroup cpu quota (e.g. 0.25), auto "
        "(the cores divided among the nodes) or none",
    )
    up.add_argument(
        "--memory-per-node",
        type=float,
        default=0,
        help="MiB each node will run (e.g. 700 for one torchrun agent and one worker): "
        "a lab the available memory cannot hold is refused",
    )
    up.add_argument(
        "--mtu",
        type=int,
        default=DEFAULT_MTU,
        help=f"every link's MTU in bytes (default {DEFAULT_MTU}, jumbo frames; 1500: plain "
        "Ethernet, whose small packets cost the lab's nodes CPU a real NIC spares them)",
    )
    up.add_argument(
        "--cpu-period-us",
        type=int,
        default=None,
        help="with --cpu-fraction: the quota's period in microseconds (1000-1000000; default "
        "100000, the kernel's): a throttled node waits up to (1 - fraction) x period",
    )
    run = sub.add_parser(
        "run", help="run a command on one node: run NODE [--private-disk DIR] -- CMD ..."
    )
    run.add_argument("node", type=int)
    run.add_argument("--private-disk", default=None)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("status")
    probe = sub.add_parser(
        "probe", help="measure the link's rate (node 1 sends to node 0), several times"
    )
    probe.add_argument("--repeats", type=int, default=5)
    probe.add_argument(
        "--allreduce", action="store_true", help="also a gloo all-reduce between all nodes"
    )
    probe.add_argument(
        "--save",
        type=Path,
        default=None,
        help="with --allreduce: write its result (JSON) here, for the scaling model's "
        "--link FILE and the dry run's dry_run.link=FILE",
    )
    sub.add_parser("down")
    for p in sub.choices.values():
        p.add_argument(
            "--prefix",
            default="ddplab",
            help="names the lab: namespaces <prefix>-node<i>, hostnames node<i> for the "
            "default, <prefix>-node<i> for any other (several labs side by side)",
        )
    args = parser.parse_args(argv)
    if args.command == "run":
        _options_before_the_command(args)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the exit
        return code
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `netlab status | head -1`: the reader has what it wanted. Python's own recipe: no
        # traceback, and nothing more written to the closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _options_before_the_command(args: argparse.Namespace) -> None:
    """`run 0 --prefix lab1 -- CMD`: argparse gives everything after the node to CMD; the
    options before `--` are run's own."""
    if "--" not in args.cmd:
        return
    split = args.cmd.index("--")
    own, args.cmd = args.cmd[:split], args.cmd[split + 1 :]
    options = argparse.ArgumentParser(prog="python -m ddp_template.tools.netlab run NODE")
    options.add_argument("--prefix", default=args.prefix)
    options.add_argument("--private-disk", default=args.private_disk)
    options.parse_args(own, namespace=args)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "up":
        if args.cpu_period_us is not None and args.cpu_fraction in (None, "none", ""):
            raise ConfigError(
                "--cpu-period-us",
                args.cpu_period_us,
                "a period for the nodes' cpu quota, which only --cpu-fraction sets: without "
                "it no node has a quota and the period would change nothing",
                "add --cpu-fraction (e.g. --cpu-fraction 0.5), or leave --cpu-period-us out",
            )
        print(
            Lab.up(
                args.nodes,
                args.rate,
                args.prefix,
                args.own_hostname,
                args.cores_per_node,
                args.cpu_fraction,
                args.memory_per_node,
                args.mtu,
                args.cpu_period_us or DEFAULT_CPU_PERIOD_US,
            ).describe()
        )
        return 0
    lab = Lab.load(args.prefix)
    if lab is None:
        if args.command == "down":
            return 0
        raise UserFacingError(
            f"No lab named {args.prefix} is up. Fix: {_this_python()} -m "
            f"ddp_template.tools.netlab up --prefix {args.prefix}"
        )
    if args.command == "down":
        lab.down()
    elif args.command == "status":
        print(lab.describe())
    elif args.command == "probe":
        _print_probe(lab, args.repeats, args.allreduce, args.save)
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return subprocess.call(lab.command(args.node, cmd, args.private_disk))
    return 0


def _this_python() -> str:
    """The running interpreter as typed here (`.venv/bin/python`): a bare `python` may be
    one without this project."""
    try:
        return Path(sys.executable).relative_to(Path.cwd()).as_posix()
    except ValueError:
        return sys.executable


def _print_probe(lab: Lab, repeats: int, allreduce: bool, save: Path | None = None) -> None:
    if repeats < 1:
        raise ConfigError("--repeats", repeats, "a whole number >= 1", "e.g. --repeats 5")
    if save is not None and (not allreduce or save.suffix != ".json"):
        raise ConfigError(
            "--save",
            str(save),
            "a .json file, with --allreduce (it saves the all-reduce probe's result)",
            f"e.g. --allreduce --save {save.with_suffix('.json').name}",
        )
    readings = lab.probe_readings(repeats=repeats)
    print(
        f"measured {format_rate(int(statistics.median(readings)))} (median of {len(readings)} "
        f"TCP readings, {_span(readings)}; links shaped to {format_rate(lab.rate_bps)})"
    )
    doubts = rate_warnings("TCP", readings, lab.rate_bps)
    if allreduce:
        measured = lab.allreduce_probe()
        rates = ", ".join(
            f"{d} {format_rate(int(b))}" for d, b in measured["bandwidth_bps"].items()
        )
        print(f"all-reduce: {rates}; {measured['latency_s'] * 1e6:,.0f} us per hop (medians)")
        busy = measured["under_compute"]
        print(
            f"while the nodes compute: float32 {format_rate(int(busy['bandwidth_bps']))}; "
            f"{busy['latency_s'] * 1e6:,.0f} us per hop; "
            f"{busy['compute_share']:.0%} of the compute's speed left"
        )
        print(
            "all-gather (FSDP's, counted as a ring's): float32 "
            f"{format_rate(int(measured['all_gather_bandwidth_bps']))}"
        )
        if "cpu_s_per_byte" in measured:
            per_byte = ", ".join(
                f"{d} {v * 1e9:.2f} ns" for d, v in measured["cpu_s_per_byte"].items()
            )
            print(
                f"a rank's CPU: {busy['cores_while_communicating']:.3f} of a core while "
                f"computing and all-reducing ({busy['cores']:.3f} computing alone); "
                f"{measured['cpu_s_per_all_reduce'] * 1e6:,.0f} us per all-reduce; per byte "
                f"sent: {per_byte}"
            )
        print(ladder_line(measured))
        if "forward_broadcast_s" in measured:
            print(
                "buffer broadcast (DDP's, at each forward's start): "
                f"{measured['broadcast_s'] * 1e3:,.1f} ms idle, "
                f"{measured['forward_broadcast_s'] * 1e3:,.1f} ms right after the nodes computed"
            )
        if save is not None:
            from ddp_template.worker.results import write_json_atomic

            write_json_atomic(save, measured)
            print(f"saved to {save} (--link {save} or dry_run.link={save})")
        doubts += measured["warnings"]
    for line in doubts:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
