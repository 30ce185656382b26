"""A multi-node SLURM cluster on the lab (`ddp_template.tools.netlab`): slurmctld on node 0
and one `slurmd -N <node>` per lab node, each inside its node's network namespace with the
node's hostname, address and cores, so that `srun` and `sbatch` tasks start in their node's
network as on a real cluster.

    python -m ddp_template.tools.slurm_lab up --nodes 2 --prefix sl    # waits until idle
    python -m ddp_template.tools.slurm_lab run --prefix sl -- sinfo    # a command on node 0
    python -m ddp_template.tools.slurm_lab down --prefix sl

Node 0 is also the login node: the lab's addresses exist only inside its namespaces, so
SLURM's commands (and `python train.py -m launcher=slurm`, which calls sbatch) run there
(`run`, `SlurmLab.command`), with `SLURM_CONF` naming this cluster's config. The cluster
has its own config, ports, state, spool and log folders and ClusterName, under
/var/lib/ddp-template-slurm-lab/<prefix>/; a one-machine SLURM (scripts/slurm_local.sh)
runs beside it untouched. munged is shared: its socket is a file, seen from every namespace.

The daemons enter a node with `nsenter --net` and a private mount and UTS namespace (the
node's hosts file bound over /etc/hosts, its hostname set), not with `ip netns exec`: that
mounts a fresh /sys, and slurmd then stops (`No filesystem mounted on /sys/fs/cgroup`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.tools.netlab import NETNS_ETC, Lab

STATE_ROOT = Path("/var/lib/ddp-template-slurm-lab")
# The one-node SLURM keeps SLURM's default ports (6817, 6818); this cluster has its own.
SLURMCTLD_PORT = 6917
SLURMD_PORT = 6918
# Job ids far from the one-node cluster's, so that a job id names one job on this machine.
FIRST_JOB_ID = 700000
PARTITION = "lab"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
# How long the nodes may take to register with slurmctld (seconds).
IDLE_WITHIN_S = 60


@dataclass
class SlurmLab:
    lab: Lab

    # --- building and removing ---------------------------------------------------------

    @classmethod
    def up(cls, nodes: int = 2, prefix: str = "slurmlab", rate: str | None = "1gbit") -> SlurmLab:
        """Builds the lab and starts its cluster, or returns the running one of this shape;
        returns once every node is idle. Needs root, network namespaces, slurm-wlm and munge."""
        _require_slurm()
        running = cls.load(prefix)
        if running and len(running.lab.nodes) == nodes and running.daemons_alive():
            # The same lab, a new link rate applied in place.
            return cls(Lab.up(nodes, rate, prefix))
        if running:
            running.down()
        made = cls(Lab.up(nodes, rate, prefix))
        try:
            made._start()
        except BaseException:
            made.down()
            raise
        return made

    @classmethod
    def load(cls, prefix: str = "slurmlab") -> SlurmLab | None:
        lab = Lab.load(prefix)
        if lab is None or not (STATE_ROOT / prefix / "slurm.conf").is_file():
            return None
        return cls(lab)

    def down(self) -> None:
        """Stops the daemons, removes the lab's namespaces and the cluster's state."""
        pids = [p for p in (self._pid(f) for f in self._pid_files()) if p is not None]
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self.lab.down()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _start(self) -> None:
        _start_munge()
        for node in self.lab.nodes:
            (self.folder / f"spool-{node.hostname}").mkdir(parents=True, exist_ok=True)
        (self.folder / "ctld").mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._config())
        self._daemon(0, ["slurmctld"], "slurmctld.log")
        for node in self.lab.nodes:
            self._daemon(node.index, ["slurmd", "-N", node.hostname], f"slurmd-{node.hostname}.log")
        self._wait_until_idle()

    def _config(self) -> str:
        head = self.lab.nodes[0]
        folder = self.folder
        # slurmd drains a node that has less memory than configured: the nodes share this
        # machine's memory, each is given an equal part of 90% of it.
        mem_mib = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
        per_node = max(256, mem_mib // len(self.lab.nodes))
        node_lines = [
            f"NodeName={n.hostname} NodeAddr={n.address} NodeHostname={n.hostname} "
            f"CPUs={len(n.cores)} RealMemory={per_node} State=UNKNOWN"
            for n in self.lab.nodes
        ]
        names = ",".join(n.hostname for n in self.lab.nodes)
        return "\n".join(
            [
                "# written by ddp_template.tools.slurm_lab",
                f"ClusterName={self.lab.prefix}lab",
                f"SlurmctldHost={head.hostname}({head.address})",
                f"SlurmctldPort={SLURMCTLD_PORT}",
                f"SlurmdPort={SLURMD_PORT}",
                f"FirstJobId={FIRST_JOB_ID}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                # A requeued job waits cred_expire + 1 s before it may start again (120 s by
                # default), as on the one-node cluster (scripts/slurm_local.sh).
                "AuthInfo=cred_expire=10",
                f"StateSaveLocation={folder}/ctld",
                f"SlurmdSpoolDir={folder}/spool-%n",
                f"SlurmctldPidFile={folder}/slurmctld.pid",
                f"SlurmdPidFile={folder}/slurmd-%n.pid",
                f"SlurmctldLogFile={folder}/slurmctld.log",
                f"SlurmdLogFile={folder}/slurmd-%n.log",
                # No cgroups in containers: plain process tracking, no task binding (a node's
                # tasks keep its cores: slurmd runs pinned to them).
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobAcctGatherType=jobacct_gather/none",
                # A job the partition can never run (more nodes than it has) is refused by
                # sbatch, as on clusters that enforce their limits, instead of waiting in
                # the queue forever (reason PartitionConfig).
                "EnforcePartLimits=ALL",
                "JobRequeue=1",
                "ReturnToService=2",
                *node_lines,
                f"PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def _daemon(self, index: int, args: list[str], log: str) -> None:
        done = subprocess.run(
            self._enter(index, args), env=self.env(), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise UserFacingError(
                f"`{' '.join(args)}` did not start on node {index} of the SLURM lab "
                f"{self.lab.prefix}: {done.stderr.strip() or done.stdout.strip()}. "
                f"Fix: see {self.folder / log}"
            )

    def _enter(self, index: int, args: Sequence[str]) -> list[str]:
        """`args` in node `index`'s network namespace, with its hostname and hosts file and
        on its cores, keeping this machine's /sys (see the module's docstring)."""
        node = self.lab.node(index)
        cores = ",".join(str(c) for c in node.cores)
        script = (
            'mount --bind "$1" /etc/hosts && hostname "$2" || exit 97; shift 2; '
            f'exec taskset -c {cores} "$@"'
        )
        hosts = NETNS_ETC / node.namespace / "hosts"
        return [
            "nsenter",
            f"--net=/run/netns/{node.namespace}",
            "unshare",
            "--mount",
            "--uts",
            "sh",
            "-c",
            script,
            "sh",
            str(hosts),
            node.hostname,
            *args,
        ]

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + IDLE_WITHIN_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.lab.nodes) and all(
                s.rstrip("*") in ("idle", "mixed", "allocated") for s in states.values()
            ):
                return
            time.sleep(0.5)
        raise UserFacingError(
            f"The SLURM lab {self.lab.prefix}'s nodes did not become idle within "
            f"{IDLE_WITHIN_S} s (states: {states or 'none'}). Fix: see the logs in {self.folder}"
        )

    # --- using it ------------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        return STATE_ROOT / self.lab.prefix

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def hostnames(self) -> list[str]:
        return [n.hostname for n in self.lab.nodes]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (this process's environment by default) with this cluster's SLURM_CONF."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def command(self, args: Sequence[str], index: int = 0) -> list[str]:
        """The command line that runs `args` on node `index` (0: the login node) as a user of
        this cluster: SLURM's commands there talk to its slurmctld."""
        return self.lab.command(index, ["env", f"SLURM_CONF={self.conf}", *args])

    def run(self, args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """`args` on the login node, its output captured (text)."""
        return subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=30)
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def daemons_alive(self) -> bool:
        return all(_alive(self._pid(f)) for f in self._pid_files())

    def _pid_files(self) -> list[Path]:
        return [self.folder / "slurmctld.pid"] + [
            self.folder / f"slurmd-{n.hostname}.pid" for n in self.lab.nodes
        ]

    @staticmethod
    def _pid(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None

    def describe(self) -> str:
        states = self.node_states()
        rows = [
            f"SLURM lab {self.lab.prefix}: cluster {self.lab.prefix}lab, partition "
            f"{PARTITION}, SLURM_CONF={self.conf}"
        ]
        for n in self.lab.nodes:
            rows.append(
                f"  {n.hostname}: {n.address}, cores {','.join(map(str, n.cores))}, "
                f"{states.get(n.hostname, 'not registered')}"
            )
        return "\n".join(rows)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _require_slurm() -> None:
    missing = [
        tool
        for tool in ("slurmctld", "slurmd", "sinfo", "munged", "nsenter")
        if shutil.which(tool) is None
    ]
    if missing:
        raise UserFacingError(
            f"The SLURM lab needs {', '.join(missing)} (slurm-wlm, munge, util-linux). "
            "Fix: apt-get install slurm-wlm munge util-linux (or bash scripts/slurm_local.sh "
            "start, which installs and starts them)"
        )


def _start_munge() -> None:
    """munged as its own user, with a key (the one-node SLURM's script does the same)."""
    if (
        MUNGE_SOCKET.exists()
        and subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0
    ):
        return
    key = Path("/etc/munge/munge.key")
    if not key.is_file() or key.stat().st_size == 0:
        key.write_bytes(os.urandom(1024))
    for folder in (Path("/run/munge"), Path("/var/log/munge"), Path("/var/lib/munge")):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    done = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"])
    if done.returncode != 0:
        raise UserFacingError("munged did not start. Fix: see /var/log/munge/munged.log")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.tools.slurm_lab", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build the lab and start its cluster (waits until idle)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--rate", default="1gbit")
    run = sub.add_parser("run", help="a command on the login node (node 0): run -- CMD ...")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("status")
    sub.add_parser("down")
    for p in sub.choices.values():
        p.add_argument("--prefix", default="slurmlab")
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "up":
        print(SlurmLab.up(args.nodes, args.prefix, args.rate).describe())
        return 0
    cluster = SlurmLab.load(args.prefix)
    if cluster is None:
        if args.command == "down":
            return 0
        raise ConfigError(
            "--prefix",
            args.prefix,
            "the prefix of a SLURM lab that is up",
            f"python -m ddp_template.tools.slurm_lab up --prefix {args.prefix}",
        )
    if args.command == "down":
        cluster.down()
    elif args.command == "status":
        print(cluster.describe())
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return subprocess.call(cluster.command(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
