"""Start-up milestones of a job's processes, shared by `startup_clock.py` (the template's
side) and `raw_ddp.py --milestones` (plain PyTorch's side) of `benchmarks/startup.py`.

Times are seconds since the epoch (`time.time()`), comparable across processes."""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process came to be (fork or exec), to about 10 ms.

    psutil adds the boot time, which Linux gives in whole seconds: up to a second off. The
    process's age against the uptime clock is exact to a clock tick."""
    with open("/proc/self/stat") as stat:
        # Fields after the command name, which may hold spaces; the start time is field 22.
        started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as uptime:
        now_since_boot = float(uptime.read().split()[0])
    age = now_since_boot - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age
