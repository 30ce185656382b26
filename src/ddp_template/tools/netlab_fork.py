"""The same Python program on every node of a lab, forked from one process that imported
torch and Lightning once, so that dozens of nodes fit on one small machine.

    python -m ddp_template.tools.netlab_fork --prefix ddplab --logs DIR -- \\
        train.py strategy=ddp devices=1 num_nodes=32 network.node_rank={node} ...

Each node's process enters its node's network namespace (`setns`), a UTS and mount
namespace of its own (its hostname; the lab's hosts file over /etc/hosts, as
`ip netns exec` does), its cores and cgroup, then runs the program as `__main__` with
`{node}` in its arguments replaced by the node's index. The nodes are as separate as under
`netlab run` in their network, names and cores; what they share is the memory of the
modules imported before the fork (copy-on-write): `import torch` alone holds about 280 MiB
private to each process that imports it, so 32 nodes of `torchrun` + worker need about
26 GiB, and this machine has 24 (docs/nodes.md).
"""

from __future__ import annotations

import argparse
import builtins
import ctypes
import gc
import importlib
import json
import os
import socket
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path

from ddp_template.errors import UserFacingError
from ddp_template.tools.netlab import CPU_CGROUPS, NETNS_ETC, Lab, Node, require_namespaces

# What a node's program imports anyway: loaded once, before the fork.
PRELOAD = ("torch", "lightning", "hydra", "ddp_template.train", "ddp_template.build")
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18


def run_on_nodes(
    lab: Lab,
    program: str,
    args: Sequence[str],
    logs: Path,
    preload: Sequence[str] = PRELOAD,
) -> dict[int, int]:
    """Forks one process per node running `program` with `args` (`{node}` replaced), each
    writing its output to `logs/node<i>.log`; returns each node's exit code. The time the
    last node started is written to `logs/started`."""
    for module in preload:
        importlib.import_module(module)
    logs.mkdir(parents=True, exist_ok=True)
    # Objects imported so far leave the collector's lists: a collection in a child would
    # otherwise write to every one of them and copy their pages into each node.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for node in lab.nodes:
        pid = os.fork()
        if pid == 0:
            _become_node(node, program, [a.replace("{node}", str(node.index)) for a in args], logs)
        children[pid] = node.index
    (logs / "started").write_text(repr(time.time()))
    codes = {}
    while children:
        pid, status = os.wait()
        codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    return dict(sorted(codes.items()))


def _become_node(node: Node, program: str, args: list[str], logs: Path) -> None:
    """In the forked child: enters the node, runs the program, never returns."""
    code = 1
    try:
        log = os.open(logs / f"node{node.index}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        _enter_node(node)
        sys.argv = [program, *args]
        run_as_main(program)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_as_main(program: str) -> None:
    """Runs `program` as `__main__`, as `python program` would, with no frame of a file
    that is no module's (runpy's are `<frozen runpy>`): torch's elastic rendezvous calls
    `inspect.stack()` on every operation, and each such frame makes inspect scan all of
    sys.modules (thousands, torch and Lightning imported) again, which slowed the nodes'
    rendezvous to minutes on a busy machine."""
    # This module stays findable by its file once `__main__` names the program.
    sys.modules.setdefault("_netlab_fork_main", sys.modules["__main__"])
    main = types.ModuleType("__main__")
    main.__file__ = program
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    # As `python program`: its folder first on the path, in place of this script's.
    sys.path[0] = str(Path(program).resolve().parent)
    exec(compile(Path(program).read_text(), program, "exec"), main.__dict__)


def _enter_node(node: Node) -> None:
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} for {node.namespace}")

    if node.cgroup is not None:
        # Before the mount namespace changes: the host's cgroup tree is visible here.
        (CPU_CGROUPS / node.cgroup / "cgroup.procs").write_text(str(os.getpid()))
    netns = os.open(f"/run/netns/{node.namespace}", os.O_RDONLY)
    check(libc.setns(netns, _CLONE_NEWNET), "setns")
    os.close(netns)
    check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate")
    hosts = str(NETNS_ETC / node.namespace / "hosts").encode()
    check(libc.mount(hosts, b"/etc/hosts", None, _MS_BIND, None), "bind-mount hosts")
    socket.sethostname(node.hostname)
    os.sched_setaffinity(0, node.cores)


def main(argv: Sequence[str] | None = None) -> int:
    if __spec__ is not None and argv is None:
        # Started with -m: again as a script, so that no runpy frame sits below the
        # program (`run_as_main`).
        os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:]])
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.tools.netlab_fork", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--prefix", default="ddplab")
    parser.add_argument("--logs", required=True, help="folder of node<i>.log and started")
    parser.add_argument("program")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        require_namespaces()
        lab = Lab.load(args.prefix)
        if lab is None:
            raise UserFacingError(
                f"No lab named {args.prefix} is up. Fix: python -m ddp_template.tools.netlab "
                f"up --prefix {args.prefix}"
            )
        program = args.program
        if not Path(program).is_file():
            raise UserFacingError(f"{program} is not a file. Fix: give the script to run")
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    codes = run_on_nodes(lab, program, rest, Path(args.logs))
    print(json.dumps(codes))
    return 0 if not any(codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
