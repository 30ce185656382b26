"""Predicts a run's step time at N nodes from one measured run, for each communication hook
and bucket size, and recommends the pair that is fastest (among pairs predicted within 5%
of each other, the one that changes less: exact gradients, PyTorch's bucket size).

    python -m ddp_template.tools.scaling outputs/<run> --nodes 2,4,8,16 --link 1gbit
    python -m ddp_template.tools.scaling outputs/<run> --nodes 8 --link 1gbit --buckets 1,25,100

The run (any run with `strategy=ddp`, one node is enough; `experiment=benchmark` measures
step times best) gives the compute per step, the data-loader wait and every gradient's
shape (results.json: `step_time_median_s`, `data_wait_fraction`, `gradients`). The model,
per step (docs/nodes.md, "The model"):

- compute: forward F, backward B, the rest R (optimizer, loop), from the run; the data
  wait D as measured. A hook's own work H (casting to half width, PowerSGD's matrix
  products, the copies in and out of DDP's buckets), measured here by a short probe on this
  machine's cores (the hook inside a one-rank DDP wrapper, the backward timed with and
  without it), is added to B.
- buckets: from the second step on, DDP groups the gradients in the order the backward
  produced them (about the reverse of the parameters' order) into buckets of
  `bucket_cap_mb`, the first one 1 MiB when the size is PyTorch's default. A bucket can be sent once the
  backward has produced its gradients: bucket k is ready at F + (B + H) * r_k, r_k the
  share of the backward elapsed when the last of its gradients was ready in the one-node
  run (results.json's gradients.ready_fractions; a ResNet-18 on 16-pixel images has 75% of
  its bytes ready at 38% of its backward), or for a run that did not record it, its bytes
  up to and including k over all bytes.
- ring all-reduce: W ranks each send and receive 2 (W - 1) / W of a bucket's bytes through
  their node's link of L bit/s, in 2 (W - 1) steps of latency a each; the ring keeps
  segments in flight, so a step's wait hides behind the next segment's transfer and the
  all-reduce takes the longer of the two times, not their sum:
      t_k = max(2 (W - 1) / W * bytes_k * c / (L / 8), 2 (W - 1) * a)
  (measured on the lab at 8 nodes and 200 Mbit/s: 1 and 4 MiB took 74.7 and 298.8 ms,
  their bytes' time; with the 14 waits of a small all-reduce added, 137.9 and 361.9;
  docs/nodes.md, "Small all-reduces on the lab".)
  c is the hook's compression: 1 (none), 1/2 (fp16, bf16), and for PowerSGD of rank r the
  factors (n + m) r instead of n m for each matrix gradient (vectors are sent whole).
- buffers: with `strategy.forward_sync_buffers` (PyTorch's default) DDP broadcasts the
  module's buffers (BatchNorm's statistics) from rank 0 at each forward's start, one
  broadcast per dtype; on gloo a binomial tree of ceil(log2 W) rounds, each the longer of
  its bytes' time and a round's wait (`buffer_broadcast_s`). It counts as exposed
  communication: nothing overlaps it.
- overlap: buckets are sent one after another, each starting when it is ready and the
  previous one is done; the step ends when both the backward and the last bucket are
  done. PowerSGD on gloo waits for each bucket inside the backward (nothing overlaps).
- contention: while a bucket is on the wire and the backward computes, the node's cores do
  both; a probed link (`--link lab`) says at what speed each then runs (the all-reduce's
  bandwidth and latency while the nodes compute, and the compute's share of its speed
  left), measured on the nodes themselves (`ddp_template.tools.allreduce_probe`; saved
  with `netlab probe --allreduce --save FILE`, `--link FILE` takes it). A rate assumes
  cores to spare: no contention. The compute and the communication are two lanes
  (`two_lanes`): DDP's backward and its buckets, FSDP's units with their all-gathers
  (at the probed all-gather's own bandwidth) and reduce-scatters (`predict_sharded`).
  With an overlap o (1 by default; `--overlap 0` for ranks whose cores are so busy that
  the transfer waits for the backward):
      exposed = o * max(0, end of the last bucket - (F + B + H)) + (1 - o) * sum of t_k
      step = F + B + H + exposed + R + D
  "exposed communication" is what the all-reduce adds to the step.
- a rank's CPU: where the run recorded its CPU per step (results.json's
  `cpu_s_per_step_over_ranks`) and the probe measured what a collective costs a rank's
  CPU and how much CPU a rank gets per second (`cores`), the collectives' CPU is counted as
  CPU, not as compute speed lost (the schedule above then runs uncontended):
      cpu = the run's CPU per step + H at the rate the run used its cores
            + all-reduces x CPU per call + bytes sent x CPU per byte
      step = max(the schedule's step, cpu / cores + exposed + D)
  On the lab's nodes of a fraction of a core a rank bound by its quota did not overlap its
  CPU with the communication left exposed (docs/nodes.md, "A CPU lane").

Scaling efficiency is one node's step time over the predicted one (the batch per device
stays the same, so N nodes process N times the samples per step at efficiency 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.tools.netlab import format_rate, parse_rate
from ddp_template.worker.comm_hooks import COMM_HOOKS, comm_hook, needs_one_bucket_at_a_time

BUCKET_CHOICES_MB = (1, 5, 10, 25, 50, 100)
# PyTorch's default: 25 MiB buckets, the first one 1 MiB (torch.distributed's
# _DEFAULT_FIRST_BUCKET_BYTES).
DEFAULT_BUCKET_MB = 25
FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class MeasuredRun:
    """What the model needs from one run's results.json."""

    step_s: float
    data_wait_s: float
    forward_s: float
    backward_s: float
    shapes: list[list[int]]
    element_bytes: int
    samples_per_step_per_device: int
    devices_per_node: int
    nodes: int
    bucket_cap_mb: float | None
    threads: int
    powersgd_rank: int
    backend: str = "gloo"
    # What DDP broadcasts from rank 0 at each forward (strategy.forward_sync_buffers), bytes
    # per dtype; empty: nothing (no buffers, the switch off, or a run that did not record it).
    broadcast_buffer_bytes: dict[str, int] = field(default_factory=dict)
    # A rank's CPU time per step (results.json's cpu_s_per_step_over_ranks, the median
    # rank); None: a run that did not record it.
    cpu_s_per_step: float | None = None
    # Per gradient (in `shapes`' order), the share of the backward elapsed when it was
    # ready (results.json's gradients.ready_fractions); None: a run that did not record
    # it, whose buckets are taken as ready in proportion to their bytes.
    ready_fractions: list[float] | None = None

    @property
    def rest_s(self) -> float:
        return max(0.0, self.step_s - self.data_wait_s - self.forward_s - self.backward_s)


@dataclass(frozen=True)
class Link:
    """Each node's link: the effective all-reduce bandwidth per dtype on the wire, and the
    latency of one ring hop. A rate (`--link 1gbit`) gives the same bandwidth to every
    dtype; a probe of the lab (`--link lab`) measures each.

    While the node computes, an all-reduce can be slower (`busy_bandwidth_bps`,
    `busy_latency_s`) and cost the compute part of its speed (`compute_share` is what is
    left): on a node with a fraction of a core gloo's threads and the backward take turns.
    A rate knows neither (no busy figures, share 1: the node's cores to spare); the lab's
    probe measures them under the nodes' quotas (`ddp_template.tools.allreduce_probe`,
    `under_compute`)."""

    bandwidth_bps: dict[str, float]
    latency_s: float = 50e-6
    busy_bandwidth_bps: dict[str, float] | None = None
    busy_latency_s: float | None = None
    compute_share: float = 1.0
    # FSDP's all-gather (float32), counted as a ring's; None: the all-reduce's float32 figure.
    gather_bandwidth_bps: float | None = None
    # One round of the broadcast of DDP's buffers at a forward's start, right after the
    # nodes computed (the probe's forward_broadcast_s over its rounds); None: latency_s.
    broadcast_round_s: float | None = None
    # The CPU a rank gets per second while it computes and all-reduces (a node's quota, less
    # what the machine could not give), and what a collective costs it: CPU seconds per call
    # and per byte it sends, per dtype. None: not probed (a rate: cores to spare).
    cores: float | None = None
    cpu_s_per_call: float = 0.0
    cpu_s_per_byte: dict[str, float] | None = None

    @classmethod
    def rated(cls, bits_per_s: float, latency_s: float = 50e-6) -> Link:
        return cls({hook.wire_dtype: bits_per_s for hook in COMM_HOOKS.values()}, latency_s)

    @classmethod
    def probed(cls, measured: dict[str, Any]) -> Link:
        bandwidth = {dtype: float(rate) for dtype, rate in measured["bandwidth_bps"].items()}
        gather = measured.get("all_gather_bandwidth_bps")
        gather_bps = float(gather) if gather else None
        broadcast = measured.get("forward_broadcast_s")
        # The probe runs gloo (allreduce_probe): its tree's rounds at the probed world size.
        round_s = (
            float(broadcast) / broadcast_rounds(int(measured["world"]), "gloo")
            if broadcast and int(measured.get("world") or 1) > 1
            else None
        )
        busy = measured.get("under_compute")
        if not busy:
            return cls(
                bandwidth,
                float(measured["latency_s"]),
                gather_bandwidth_bps=gather_bps,
                broadcast_round_s=round_s,
            )
        # Measured for float32; the other dtypes slow down by the same ratio.
        slowed = float(busy["bandwidth_bps"]) / bandwidth["float32"]
        per_byte = measured.get("cpu_s_per_byte")
        cores = busy.get("cores_while_communicating")
        return cls(
            bandwidth,
            float(measured["latency_s"]),
            {dtype: rate * slowed for dtype, rate in bandwidth.items()},
            float(busy["latency_s"]),
            float(busy["compute_share"]),
            gather_bps,
            round_s,
            float(cores) if cores and per_byte else None,
            float(measured.get("cpu_s_per_all_reduce") or 0.0),
            {dtype: float(v) for dtype, v in per_byte.items()} if per_byte else None,
        )

    def transfer_s(
        self, wire_dtype: str, bits: float, hops: int, busy: bool = False, gather: bool = False
    ) -> float:
        """Seconds of one collective: its bits at the bandwidth or a latency per hop,
        whichever takes longer (the ring's segments in flight hide one behind the other);
        `busy`: while the node computes; `gather`: FSDP's all-gather, at its own bandwidth
        where probed (slowed while busy as the all-reduce is)."""
        bandwidth, latency = self.bandwidth_bps[wire_dtype], self.latency_s
        if gather and self.gather_bandwidth_bps:
            bandwidth = self.gather_bandwidth_bps
        if busy and self.busy_bandwidth_bps is not None:
            bandwidth *= self.busy_bandwidth_bps[wire_dtype] / self.bandwidth_bps[wire_dtype]
            latency = self.busy_latency_s or self.latency_s
        return max(bits / bandwidth, hops * latency)

    def describe(self) -> str:
        rates = ", ".join(f"{d} {format_rate(int(b))}" for d, b in self.bandwidth_bps.items())
        text = f"{rates}; {self.latency_s * 1e6:.0f} us per hop"
        if self.busy_bandwidth_bps is not None:
            text += (
                f"; while computing float32 {format_rate(int(self.busy_bandwidth_bps['float32']))}, "
                f"{(self.busy_latency_s or 0) * 1e6:.0f} us per hop, "
                f"{self.compute_share:.0%} of the compute's speed left"
            )
        if self.gather_bandwidth_bps:
            text += f"; all-gather float32 {format_rate(int(self.gather_bandwidth_bps))}"
        if self.broadcast_round_s is not None:
            text += f"; buffer broadcast {self.broadcast_round_s * 1e6:.0f} us per round"
        if self.cores is not None and self.cpu_s_per_byte is not None:
            text += (
                f"; a rank's CPU: {self.cores:.3f} of a core while computing and all-reducing, "
                f"{self.cpu_s_per_call * 1e6:.0f} us per all-reduce, "
                f"{self.cpu_s_per_byte['float32'] * 1e9:.2f} ns per float32 byte sent"
            )
        return text


@dataclass(frozen=True)
class Prediction:
    nodes: int
    hook: str
    bucket_cap_mb: float | None
    compute_s: float
    exposed_comm_s: float
    data_wait_s: float
    step_s: float
    samples_per_s: float
    efficiency: float
    # Part of exposed_comm_s: DDP's buffer broadcast at the forward's start.
    buffer_broadcast_s: float = 0.0
    # The shortest step a rank's CPU allows on its node (`rank_cpu_s` over the link's cores,
    # plus the exposed communication); None: not known.
    cpu_floor_s: float | None = None
    # The CPU a rank spends per step that floor assumes (`rank_cpu_s`); None: not known.
    rank_cpu_s: float | None = None


def load_run(job: Path) -> MeasuredRun:
    results = job / "results.json"
    if not results.is_file():
        raise ConfigError(
            "job folder",
            str(job),
            "a run's folder holding results.json",
            "give the folder a run printed as its output folder, e.g. outputs/<date>/<time>",
        )
    record = json.loads(results.read_text())
    gradients = record.get("gradients")
    step = record.get("step_time_median_s")
    if not gradients or not step:
        raise ConfigError(
            "job folder",
            str(job),
            "a run trained with strategy=ddp (results.json needs `gradients` and "
            "`step_time_median_s`; this run has "
            f"{'no DDP wrapper' if not gradients else 'no measured step'})",
            "measure one: python train.py experiment=benchmark strategy=ddp devices=1",
        )
    config = record.get("config", {})
    strategy = config.get("strategy", {})
    data_wait = float(step) * float(record.get("data_wait_fraction") or 0.0)
    forward, backward = (
        float(gradients["forward_compute_s"]),
        float(gradients["backward_compute_s"]),
    )
    # DDP times one sampled step; the median step is the better total: keep DDP's split.
    scale = min(1.0, (float(step) - data_wait) / max(forward + backward, 1e-9))
    return MeasuredRun(
        step_s=float(step),
        data_wait_s=data_wait,
        forward_s=forward * scale,
        backward_s=backward * scale,
        shapes=gradients["shapes"],
        element_bytes=int(gradients["element_bytes"]),
        samples_per_step_per_device=int(record["batch_size_per_device"])
        * int(record.get("accumulate_grad_batches") or 1),
        devices_per_node=int(record.get("devices_per_node") or 1),
        nodes=int(record.get("num_nodes") or 1),
        bucket_cap_mb=(record.get("ddp") or {}).get("bucket_cap_mb")
        if strategy.get("bucket_cap_mb") is not None
        else None,
        threads=int(gradients.get("torch_threads") or 1),
        powersgd_rank=int(strategy.get("powersgd_rank") or 1),
        backend=str(gradients.get("backend") or "gloo"),
        broadcast_buffer_bytes={
            dtype: int(nbytes)
            for dtype, nbytes in (gradients.get("broadcast_buffer_bytes") or {}).items()
        },
        cpu_s_per_step=float(cpu["median"])
        if (cpu := record.get("cpu_s_per_step_over_ranks")) and cpu.get("median")
        else None,
        ready_fractions=[float(share) for share in ready]
        if (ready := gradients.get("ready_fractions")) and len(ready) == len(gradients["shapes"])
        else None,
    )


def buckets(shapes: list[list[int]], element_bytes: int, cap_mb: float | None) -> list[list[int]]:
    """Indices of the gradients in each bucket, in the order DDP fills and sends them."""
    cap = int((cap_mb or DEFAULT_BUCKET_MB) * 2**20)
    first = FIRST_BUCKET_BYTES if cap_mb is None else cap
    # DDP's rule (reducer.cpp, compute_bucket_assignment_by_size): a bucket closes once
    # it has reached its limit, so it can exceed the limit by its last gradient.
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, shape in enumerate(shapes):
        current.append(index)
        size += math.prod(shape) * element_bytes
        if size >= (first if not groups else cap):
            groups.append(current)
            current, size = [], 0
    return groups + [current] if current else groups


def sent_bytes(shape: list[int], element_bytes: int, hook: str, rank: int) -> float:
    """Bytes the hook puts on the wire for one gradient."""
    return comm_hook(hook).sent_bytes(shape, element_bytes, rank)


def probe_hook_costs(
    run: MeasuredRun, hooks: Sequence[str], bucket_cap_mb: float | None = None
) -> dict[str, float]:
    """Seconds of compute each hook adds per step on this machine, on the run's thread count.

    The probe runs the hook as the worker registers it (the project's CountingHook and the
    hook's state, PowerSGD's per-parameter bookkeeping included) inside a real DDP wrapper of
    one rank (gloo, in this process) over parameters of the run's shapes, and times the same
    backward with and without it: the casts, PowerSGD's products, and the copies into and out
    of DDP's buckets, its futures and the error feedback. Timing the casts and products
    alone read a quarter of what the hooks cost in training (docs/nodes.md)."""
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(run.threads)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    models: dict[str, Any] = {}
    try:
        names = ["none", *(h for h in hooks if h != "none")]
        models.update((name, _probe_model(run, name, bucket_cap_mb)) for name in names)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        # PowerSGD compresses from its second step on (the worker's start_iter is >= 2);
        # DDP rebuilds its buckets after the first: time neither.
        for repeat in range(PROBE_WARMUP + PROBE_REPEATS):
            # Interleaved, so that other work on the cores slows every hook alike.
            for name, model in models.items():
                elapsed = _probe_step(model)
                if repeat >= PROBE_WARMUP:
                    seconds[name].append(elapsed)
        base = statistics.median(seconds["none"])
        return {
            h: max(0.0, statistics.median(seconds[h]) - base) if h != "none" else 0.0 for h in hooks
        }
    finally:
        # The wrappers and their hooks' futures go first, here: the group must not be
        # freed last on one of gloo's own threads (its destructor joins them: a process
        # abort, "Resource deadlock avoided", seen once in a test).
        models.clear()
        gc.collect()
        if own_group:
            dist.destroy_process_group()
        torch.set_num_threads(threads)


PROBE_WARMUP = 3
PROBE_REPEATS = 7


def _probe_model(run: MeasuredRun, hook: str, bucket_cap_mb: float | None) -> Any:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from ddp_template.worker.comm_hooks import CountingHook, PowerSGDByParameter, hook_state

    class Gradients(torch.nn.Module):
        """Parameters of the run's shapes; the backward gives each its full gradient."""

        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.zeros(shape)) for shape in run.shapes
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([(w * x).sum() for w in self.weights]).sum()

    # None: PyTorch's default (25 MiB, the first bucket 1 MiB), as in the worker.
    model = DistributedDataParallel(Gradients(), bucket_cap_mb=bucket_cap_mb)
    if comm_hook(hook).function is not None:
        state = hook_state(hook, run.powersgd_rank, 2)
        counting = CountingHook(hook, one_bucket_at_a_time=needs_one_bucket_at_a_time(hook, "gloo"))
        if isinstance(state, powerSGD_hook.PowerSGDState):
            counting.by_parameter = PowerSGDByParameter(model.module)
        model.register_comm_hook(state, counting)
    return model


def _probe_step(model: Any) -> float:
    import torch

    x = torch.ones(())
    start = time.perf_counter()
    model(x).backward()
    return time.perf_counter() - start


def predict(
    run: MeasuredRun,
    nodes: int,
    hook: str,
    link: Link,
    hook_cost_s: float,
    bucket_cap_mb: float | None,
    overlap: float | None = None,
) -> Prediction:
    world = nodes * run.devices_per_node
    backward = run.backward_s + hook_cost_s
    compute_end = run.forward_s + backward
    # With a rank's CPU known (the run's and the probe's), the collectives' CPU is counted
    # as CPU (`rank_cpu_s`), not as the compute's speed lost while a bucket is on the wire.
    cpu_counted = run.cpu_s_per_step is not None and link.cores is not None
    share = 1.0 if cpu_counted else link.compute_share
    groups = buckets(run.shapes, run.element_bytes, bucket_cap_mb)
    sizes = [sum(math.prod(run.shapes[i]) * run.element_bytes for i in g) for g in groups]
    transfers: list[Transfer] = []
    ready = bucket_ready_shares(run, groups, sizes)
    # What the rank sends per step, in bytes, and how many collectives it calls.
    sent_total, calls = 0.0, 0
    if world > 1:
        ring = 2 * (world - 1) / world
        spec = comm_hook(hook)
        # PowerSGD makes three all-reduces per bucket, one after another (the vectors sent
        # whole, P, Q): three times the latency.
        hops = spec.all_reduces * 2 * (world - 1)
        for group, ready_share in zip(groups, ready, strict=True):
            wire = sum(
                sent_bytes(run.shapes[i], run.element_bytes, hook, run.powersgd_rank) for i in group
            )
            bits = ring * wire * 8
            sent_total += ring * wire
            calls += spec.all_reduces
            transfers.append(
                Transfer(
                    backward * ready_share,
                    link.transfer_s(spec.wire_dtype, bits, hops),
                    link.transfer_s(spec.wire_dtype, bits, hops, busy=not cpu_counted),
                )
            )
    sent_s = sum(t.alone_s for t in transfers)
    end = run.forward_s + overlapped_backward(backward, transfers, share)
    overlap = run_overlap(run) if overlap is None else overlap
    if needs_one_bucket_at_a_time(hook, run.backend):
        # The hook waits for each bucket inside the backward (comm_hooks.CountingHook):
        # nothing overlaps, every bucket's time adds to the step.
        overlap = 0.0
    buffers_s = buffer_broadcast_s(run, world, link)
    exposed = overlap * max(0.0, end - compute_end) + (1 - overlap) * sent_s + buffers_s
    step = compute_end + exposed + run.rest_s + run.data_wait_s
    if world > 1:
        calls += len(run.broadcast_buffer_bytes)
    cpu = rank_cpu_s(run, link, hook_cost_s, calls, sent_total, comm_hook(hook).wire_dtype)
    floor = None
    if cpu is not None and link.cores:
        # A node of a fraction of a core: the rank's CPU at the CPU its node gives it, then
        # the communication the schedule leaves exposed (the lab's nodes, bound by their
        # quota, did not overlap the two: docs/nodes.md, "A CPU lane").
        floor = cpu / link.cores + exposed + run.data_wait_s
        if floor > step:
            exposed += floor - step
            step = floor
    samples = world * run.samples_per_step_per_device / step
    one_node = run.forward_s + run.backward_s + run.rest_s + run.data_wait_s
    return Prediction(
        nodes,
        hook,
        bucket_cap_mb,
        compute_end + run.rest_s,
        exposed,
        run.data_wait_s,
        step,
        samples,
        one_node / step,
        buffers_s,
        floor,
        cpu if floor is not None else None,
    )


def bucket_ready_shares(run: MeasuredRun, groups: list[list[int]], sizes: list[int]) -> list[float]:
    """For each bucket, the share of the backward done when its last gradient is ready: the
    one-node run's measured ready times (`ready_fractions`) where it recorded them, else its
    bytes so far over all bytes. Never earlier than the bucket before: DDP sends them in
    order."""
    shares, latest, done_bytes = [], 0.0, 0
    total = sum(sizes) or 1
    for group, nbytes in zip(groups, sizes, strict=True):
        done_bytes += nbytes
        if run.ready_fractions is not None:
            share = max((run.ready_fractions[i] for i in group), default=0.0)
        else:
            share = done_bytes / total
        latest = max(latest, share)
        shares.append(latest)
    return shares


def rank_cpu_s(
    run: MeasuredRun,
    link: Link,
    hook_cost_s: float,
    calls: int,
    sent_bytes_per_step: float,
    wire_dtype: str,
) -> float | None:
    """A rank's CPU seconds per step at N nodes: the one-node run's (which communicates
    nothing), the hook's own compute at the rate that run used its cores, and the
    collectives': `calls` all-reduces (and buffer broadcasts) at the probe's CPU per call
    and the bytes the rank sends at its CPU per byte. None where the run or the link does
    not say (a rate: cores to spare)."""
    if run.cpu_s_per_step is None or link.cores is None or link.cpu_s_per_byte is None:
        return None
    run_cores = run.cpu_s_per_step / max(run.step_s - run.data_wait_s, 1e-9)
    return (
        run.cpu_s_per_step
        + hook_cost_s * run_cores
        + calls * link.cpu_s_per_call
        + sent_bytes_per_step * link.cpu_s_per_byte.get(wire_dtype, 0.0)
    )


def broadcast_rounds(world: int, backend: str) -> int:
    """Sends one after another in a broadcast from one rank: gloo's binomial tree
    (gloo/broadcast.cc) takes ceil(log2 W) rounds, each a whole send; NCCL's pipelined
    chain passes the data along W - 1 hops (its bytes once, counted by the caller)."""
    if world <= 1:
        return 0
    return math.ceil(math.log2(world)) if backend == "gloo" else world - 1


def buffer_broadcast_s(run: MeasuredRun, world: int, link: Link) -> float:
    """DDP's broadcast of the module's buffers at the start of each forward
    (`strategy.forward_sync_buffers`, on by default): one broadcast per dtype (torch's
    broadcast_coalesced groups the buffers by type and keeps two in flight, so a pair takes
    as long as its longer one). On gloo each of the tree's rounds sends the whole buffer:
    the longer of its bytes' time and a round's wait, the probe's `forward_broadcast_s`
    per round where probed (rank 0 waits for its children to finish the step before; on
    the 8-node lab the jobs' forward lost 18 to 203 ms to it, where the probe read 19 ms:
    docs/nodes.md). NCCL: the bytes once, W - 1 waits."""
    if world <= 1 or not run.broadcast_buffer_bytes:
        return 0.0
    rounds = broadcast_rounds(world, run.backend)
    wait = link.broadcast_round_s if link.broadcast_round_s is not None else link.latency_s
    bandwidth = link.bandwidth_bps["float32"]
    times = []
    for nbytes in run.broadcast_buffer_bytes.values():
        if run.backend == "gloo":
            times.append(rounds * max(nbytes * 8 / bandwidth, wait))
        else:
            times.append(max(nbytes * 8 / bandwidth, rounds * wait))
    # Two in flight: the broadcasts go in pairs, each pair as long as its longer one.
    return sum(max(times[i : i + 2]) for i in range(0, len(times), 2))


@dataclass(frozen=True)
class Transfer:
    """One bucket's all-reduce: ready once the backward has computed `ready_s` of its
    seconds; it takes `alone_s` on a node that does nothing else, `busy_s` while the node
    computes."""

    ready_s: float
    alone_s: float
    busy_s: float


def overlapped_backward(
    backward_s: float, transfers: list[Transfer], compute_share: float
) -> float:
    """Seconds from the backward's start until its compute and every bucket's all-reduce
    are done. The buckets go one at a time, each once the backward has produced it; while
    one is on the wire and the backward computes, the transfer runs at its busy speed and
    the compute at `compute_share` of its own; alone, each at its own. With the link's
    defaults (busy = alone, share 1) this is the plain schedule: bucket k ends at
    max(ready_k, end of k - 1) + t_k."""
    points = sorted({min(max(t.ready_s, 0.0), backward_s) for t in transfers} | {backward_s})
    # The backward cut at the buckets' ready points; a bucket waits for the piece it ends.
    pieces, done_at, previous = [], {}, 0.0
    for point in points:
        if point > previous:
            pieces.append(Work(point - previous))
            previous = point
        done_at[point] = len(pieces) - 1
    sends = [
        Work(t.alone_s, t.busy_s, done_at[min(max(t.ready_s, 0.0), backward_s)]) for t in transfers
    ]
    return max(two_lanes(pieces, sends, compute_share))


@dataclass(frozen=True)
class Work:
    """One task of a lane of `two_lanes`: `alone_s` seconds on a node that does nothing
    else, `busy_s` (communication only) while the other lane is active; it starts once
    its lane's previous task and the other lane's task `after` (an index; -1: none) are
    done."""

    alone_s: float
    busy_s: float | None = None
    after: int = -1


def two_lanes(compute: list[Work], comm: list[Work], compute_share: float) -> tuple[float, float]:
    """When the compute lane and the communication lane finish, each running its tasks in
    order. While both are active the node does both: the compute at `compute_share` of its
    speed, the communication at its busy speed; alone, each at its own. DDP's backward and
    its buckets, and FSDP's units with their all-gathers and reduce-scatters, are such
    schedules."""
    lanes = (compute, comm)
    clock = 0.0
    ends = [0.0, 0.0]
    done = [0, 0]  # each lane's finished tasks: the index of its running or next task
    left: list[float | None] = [None, None]  # the share of each lane's running task to do
    while True:
        for lane in (0, 1):
            waiting = left[lane] is None and done[lane] < len(lanes[lane])
            if waiting and lanes[lane][done[lane]].after < done[1 - lane]:
                left[lane] = 1.0
        running = [share is not None for share in left]
        if not any(running):
            if done != [len(compute), len(comm)]:
                raise ValueError("two_lanes: a task waits for one that never runs")
            return ends[0], ends[1]
        # Seconds each running task still needs at the current speeds.
        needs = [math.inf, math.inf]
        share_left = left[0]
        if share_left is not None:
            rate = compute_share if running[1] else 1.0
            seconds = share_left * compute[done[0]].alone_s
            needs[0] = seconds / rate if rate > 0 else (0.0 if seconds == 0 else math.inf)
        share_left = left[1]
        if share_left is not None:
            task = comm[done[1]]
            busy = task.busy_s if running[0] and task.busy_s is not None else None
            needs[1] = share_left * (task.alone_s if busy is None else busy)
        elapsed = min(needs)
        clock += elapsed
        for lane in (0, 1):
            share_left = left[lane]
            if share_left is None:
                continue
            if needs[lane] - elapsed <= 1e-12:
                left[lane] = None
                done[lane] += 1
                ends[lane] = clock
            else:
                left[lane] = share_left * (1 - elapsed / needs[lane])


def reduce_scatter_factor(backend: str, world: int) -> float:
    """Bytes each rank sends in a reduce-scatter, per byte of the unit reduced: the ring's
    (W - 1) / W on NCCL; ProcessGroupGloo has no reduce-scatter of its own and runs an
    all-reduce of the whole unit, 2 (W - 1) / W. Measured on the lab (42.6 MiB, 200 Mbit/s):
    the reduce-scatter took as long as the all-reduce of the same tensor, 1.93 s against
    1.90 s at W = 2 and 2.89 s against 2.84 s at W = 4 (the ring would take half)."""
    ring = (world - 1) / world
    return 2 * ring if backend == "gloo" else ring


def fsdp_overlaps(backend: str) -> bool:
    """Whether FSDP2 overlaps its collectives with the compute. On GPUs (NCCL) it does:
    the all-gathers and reduce-scatters run on CUDA streams of their own while the CPU
    issues the next unit. On CPUs (gloo) it does not: there are no such streams, a unit's
    all-gather (`unshard(async_op=False)`, prefetches included) and its gradients'
    reduce-scatter (no async_op) complete on the thread that computes before it goes on
    (torch 2.14's fsdp/_fully_shard/_fsdp_param_group.py and _fsdp_collectives.py). The
    2-node lab at 1 Gbit/s measured 1.436 s a step against 1.149 s predicted with
    overlap (docs/fsdp.md)."""
    return backend != "gloo"


def predict_sharded(
    run: MeasuredRun,
    nodes: int,
    link: Link,
    units: list[dict[str, Any]],
    reshard_after_forward: bool,
) -> Prediction:
    """FSDP's step (`strategy=fsdp`): `units` are the bytes each unit gathers, the root
    first, in the forward's order (config/dry_run_sharded.py). One collective at a time on
    the link, each a ring of W - 1 steps sending (W - 1) / W of its bytes per rank:
        t(bytes) = max((W - 1) / W * bytes / (L / 8), (W - 1) * a)
    except the reduce-scatter on gloo, an all-reduce of the unit (`reduce_scatter_factor`);
    a probed link gives the all-gather its own bandwidth (gloo's is no ring) and, while a
    unit computes, the busy speeds and the compute's share (`two_lanes`). On CPUs (gloo)
    nothing overlaps (`fsdp_overlaps`): the step is F + B + every collective + R + D.
    Forward: unit k computes once its all-gather is done and unit k - 1 has computed; the
    all-gather of k + 1 (prefetched) runs meanwhile. The compute of a unit is F (or B) in
    proportion to its bytes (a proxy: the FLOPs per byte of parameter differ per layer).
    Backward, in reverse: each resharded unit is gathered again before its gradients, which
    are then reduce-scattered; the step ends when the compute and the last reduce-scatter
    are done. Exposed communication is what the collectives add to F + B; checked against
    measured 2-node runs on the lab (docs/fsdp.md)."""
    world = nodes * run.devices_per_node
    sizes = [int(u["bytes"]) for u in units]
    total = sum(sizes) or 1
    dtype = comm_hook("none").wire_dtype
    scatter = reduce_scatter_factor(run.backend, world)
    count = len(sizes)

    def wire(k: int, after: int, gather: bool = True) -> Work:
        factor = (world - 1) / world if gather else scatter
        if world == 1 or sizes[k] == 0:
            return Work(0.0, 0.0, after)
        hops = round(factor * world)  # W - 1 per ring pass
        bits = factor * sizes[k] * 8
        return Work(
            link.transfer_s(dtype, bits, hops, gather=gather),
            link.transfer_s(dtype, bits, hops, busy=True, gather=gather),
            after,
        )

    # The compute lane: the units' forwards, then their backwards in reverse; unit k's
    # forward is task k, its backward task 2 count - 1 - k.
    forward = [run.forward_s * n / total for n in sizes]
    backward = [run.backward_s * n / total for n in sizes]
    sends: list[Work] = []
    gathered_at: dict[int, int] = {}  # compute task -> the send it waits for
    # Forward: unit 0's all-gather first; unit k + 1's is prefetched as unit k's forward
    # starts (once unit k - 1 has computed).
    for k in range(count):
        gathered_at[k] = len(sends)
        sends.append(wire(k, k - 2 if k else -1))
    regather = [reshard_after_forward and k > 0 and n > 0 for k, n in enumerate(sizes)]
    last = count - 1
    # Backward, in reverse: each resharded unit gathered again (prefetched as the unit
    # after it starts its backward), its gradients reduce-scattered once computed.
    if regather[last]:
        gathered_at[count] = len(sends)
        sends.append(wire(last, last))
    for k in reversed(range(count)):
        task = 2 * count - 1 - k
        if k > 0 and regather[k - 1]:
            gathered_at[task + 1] = len(sends)
            sends.append(wire(k - 1, task - 1))
        sends.append(wire(k, task, gather=False))
    compute = [
        Work(seconds, after=gathered_at.get(task, -1))
        for task, seconds in enumerate(forward + backward[::-1])
    ]
    if fsdp_overlaps(run.backend):
        compute_end, comm_end = two_lanes(compute, sends, link.compute_share)
        exposed = max(0.0, max(compute_end, comm_end) - run.forward_s - run.backward_s)
    else:
        # Each collective blocks the thread that computes: one after another, alone.
        exposed = sum(send.alone_s for send in sends)
    step = run.forward_s + run.backward_s + exposed + run.rest_s + run.data_wait_s
    one_node = run.forward_s + run.backward_s + run.rest_s + run.data_wait_s
    return Prediction(
        nodes,
        "none",
        None,
        run.forward_s + run.backward_s + run.rest_s,
        exposed,
        run.data_wait_s,
        step,
        world * run.samples_per_step_per_device / step,
        one_node / step,
    )


def run_overlap(run: MeasuredRun) -> float:
    """How much of the schedule above hides the all-reduce behind the backward: all of it
    (1) unless `--overlap` says otherwise. Measured on the lab (docs/nodes.md), gloo on one
    quiet core per node overlaps as the schedule says (bucket_cap_mb=1: 0.555 s per step
    against 0.766 s with one 100 MiB bucket at 1 Gbit/s); on cores shared with other work
    the overlap vanished (0 fits better there)."""
    return 1.0


def parse_nodes(text: str) -> list[int]:
    try:
        counts = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(count < 1 for count in counts):
        raise ConfigError(
            "--nodes", text, "node counts >= 1, separated by commas", "e.g. --nodes 2,4,8,16"
        )
    return counts


def parse_buckets(text: str) -> list[float | None]:
    sizes: list[float | None] = []
    for part in (p.strip() for p in str(text).split(",")):
        try:
            size = None if part == "null" else float(part)
        except ValueError:
            size = -1.0
        if size is not None and not size > 0:
            sizes = []
            break
        sizes.append(size)
    if not sizes:
        raise ConfigError(
            "--buckets",
            text,
            "bucket sizes in MiB > 0 (or null, PyTorch's default), separated by commas",
            "e.g. --buckets 1,25,100",
        )
    return sizes


def report(
    run: MeasuredRun,
    counts: list[int],
    link: Link,
    hooks: Sequence[str],
    costs: dict[str, float],
    overlap: float | None = None,
    bucket_sizes: Sequence[float | None] | None = None,
) -> list[str]:
    """The command's lines: a prediction per node count, hook and bucket size (the run's
    bucket size unless `bucket_sizes` are given), then the fastest pair per node count among
    the hooks and `bucket_sizes` (every size in BUCKET_CHOICES_MB when none are given)."""
    lines = [
        f"measured: step {run.step_s:.3f} s (forward {run.forward_s:.3f}, backward "
        f"{run.backward_s:.3f}, rest {run.rest_s:.3f}, data wait {run.data_wait_s:.3f}), "
        f"{sum(math.prod(s) for s in run.shapes) * run.element_bytes / 2**20:.1f} MiB of "
        f"gradients, {run.devices_per_node} device(s) per node; link: {link.describe()}",
        "hook compute per step (probe): "
        + ", ".join(f"{h} {costs[h] * 1000:.0f} ms" for h in hooks),
    ]
    shown = list(bucket_sizes) if bucket_sizes else [run.bucket_cap_mb]
    choices = list(bucket_sizes) if bucket_sizes else [None, *BUCKET_CHOICES_MB]
    for count in counts:
        for hook, bucket in ((h, b) for h in hooks for b in shown):
            p = predict(run, count, hook, link, costs[hook], bucket, overlap)
            lines.append(
                f"nodes={count} hook={hook} bucket_cap_mb={_mb(bucket)} compute {p.compute_s:.3f} s "
                f"exposed comm {p.exposed_comm_s:.3f} s{_buffers(p)} data wait {p.data_wait_s:.3f} s "
                f"{_floor(p)}predicted step time: {p.step_s:.3f} s  samples/s {p.samples_per_s:.1f}  "
                f"scaling efficiency {p.efficiency:.0%}"
            )
    for count in counts:
        candidates = [
            predict(run, count, hook, link, costs[hook], cap, overlap)
            for hook in hooks
            for cap in choices
        ]
        best = recommend(candidates)
        fastest = min(candidates, key=lambda p: p.step_s)
        caveat = (
            "; PowerSGD approximates the gradients: compare the accuracy with comm_hook=none"
            if best.hook == "powersgd"
            else ""
        )
        if best.step_s > fastest.step_s:
            caveat += (
                f"; hook={fastest.hook} bucket_cap_mb={_mb(fastest.bucket_cap_mb)} is predicted "
                f"{fastest.step_s:.3f} s, within {TIE_SHARE:.0%}: a tie, and this pair changes "
                "less (the gradients, PyTorch's default bucket size)"
            )
        lines.append(
            f"recommended at nodes={count}: strategy.comm_hook={best.hook} "
            f"strategy.bucket_cap_mb={_mb(best.bucket_cap_mb)} (predicted step {best.step_s:.3f} s, "
            f"scaling efficiency {best.efficiency:.0%}){caveat}"
        )
    return lines


# Predictions this close to the fastest are a tie: the model cannot order them (two runs of
# one setting on the lab differ by 4.4% at the median, docs/nodes.md), so a recommendation
# does not change the gradients or PyTorch's defaults for less.
TIE_SHARE = 0.05


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """The pair to recommend: among the predictions within TIE_SHARE of the fastest, the
    hook that sends the most exact gradients (none, then half width, then PowerSGD), then
    the bucket size nearest PyTorch's default, then the fastest."""
    fastest = min(p.step_s for p in predictions)
    ties = [p for p in predictions if p.step_s <= fastest * (1 + TIE_SHARE)]
    return min(
        ties,
        key=lambda p: (comm_hook(p.hook).approximation, _from_default(p.bucket_cap_mb), p.step_s),
    )


def _from_default(cap_mb: float | None) -> float:
    """How far a bucket size is from PyTorch's default (None: the default itself), as a
    factor: 25 and None 0, 50 and 12.5 alike."""
    return 0.0 if cap_mb is None else abs(math.log(cap_mb / DEFAULT_BUCKET_MB))


def link_of(text: str, latency_s: float, option: str, lab_prefix: str | None = None) -> Link:
    """Each node's link from what a user gives `option`: a rate (`1gbit`: every collective
    a ring at that rate, `latency_s` a hop, cores to spare), a probe's JSON file (what
    `python -m ddp_template.tools.netlab probe --allreduce --save FILE` or rank 0 of
    `ddp_template.tools.allreduce_probe` wrote, on the nodes to be used), or, where
    `lab_prefix` is given, `lab`: the running netlab, probed now."""
    if lab_prefix is not None and text == "lab":
        from ddp_template.tools.netlab import Lab

        lab = Lab.load(lab_prefix)
        if lab is None:
            raise ConfigError(
                option,
                text,
                f"a running netlab to probe (none named {lab_prefix} is up)",
                "python -m ddp_template.tools.netlab up --rate 1gbit, or give a rate: "
                f"{option} 1gbit",
            )
        return Link.probed(lab.allreduce_probe())
    allowed = "a link rate (e.g. 10gbit), a probe's .json file" + (
        ", or lab" if lab_prefix is not None else ""
    )
    if str(text).endswith(".json"):
        return Link.probed(_probe_file(Path(str(text)), option, allowed))
    try:
        rate = parse_rate(str(text))
    except ConfigError:
        rate = None
    if rate is None:
        raise ConfigError(option, text, allowed, f"e.g. {option} 1gbit")
    return Link.rated(rate, latency_s)


def _probe_file(path: Path, option: str, allowed: str) -> dict[str, Any]:
    fix = (
        "write one with python -m ddp_template.tools.netlab probe --allreduce --save "
        f"{path} (or give a rate: {option} 1gbit)"
    )
    if not path.is_file():
        raise ConfigError(option, str(path), f"{allowed}; this file does not exist", fix)
    try:
        measured = json.loads(path.read_text())
        float(measured["bandwidth_bps"]["float32"])
        float(measured["latency_s"])
    except (ValueError, KeyError, TypeError) as why:
        raise ConfigError(
            option,
            str(path),
            f"{allowed}; this file is not an all-reduce probe's result ({why!r} missing or "
            "unreadable: it needs bandwidth_bps.float32 and latency_s)",
            fix,
        ) from None
    return measured


def _floor(p: Prediction) -> str:
    if p.cpu_floor_s is None or p.rank_cpu_s is None:
        return ""
    return f"CPU floor {p.cpu_floor_s:.3f} s (a rank's CPU {p.rank_cpu_s:.3f} s a step) "


def _buffers(p: Prediction) -> str:
    return f" (buffer broadcast {p.buffer_broadcast_s:.3f} s)" if p.buffer_broadcast_s else ""


def _mb(cap: float | None) -> str:
    return "null" if cap is None else f"{cap:g}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.tools.scaling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("job", type=Path, help="a run's folder (its results.json)")
    parser.add_argument("--nodes", default="2,4,8,16", help="node counts, e.g. 2,4,8,16")
    parser.add_argument(
        "--link",
        default="10gbit",
        help="each node's link rate (e.g. 1gbit), a probe's .json file (netlab probe "
        "--allreduce --save FILE), or `lab`: probe the running netlab",
    )
    parser.add_argument("--latency-us", type=float, default=50.0, help="per ring hop (a rate)")
    parser.add_argument("--lab", default="ddplab", help="the netlab probed by --link lab")
    parser.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="share of the schedule's overlap with the backward that happens (default 1)",
    )
    parser.add_argument("--hooks", default=",".join(COMM_HOOKS))
    parser.add_argument(
        "--buckets",
        default=None,
        help="bucket sizes in MiB to predict and choose from, e.g. 1,25,100 (null: PyTorch's "
        "default); by default the run's size is predicted and every size in "
        f"{','.join(map(str, BUCKET_CHOICES_MB))} is a choice",
    )
    args = parser.parse_args(argv)
    try:
        counts = parse_nodes(args.nodes)
        link = link_of(args.link, args.latency_us * 1e-6, "--link", args.lab)
        hooks = [h for h in args.hooks.split(",") if h]
        unknown = [h for h in hooks if h not in COMM_HOOKS]
        if unknown or not hooks:
            raise ConfigError(
                "--hooks", args.hooks, f"names from {', '.join(COMM_HOOKS)}", "--hooks none,fp16"
            )
        bucket_sizes = parse_buckets(args.buckets) if args.buckets is not None else None
        run = load_run(args.job)
        costs = probe_hook_costs(run, hooks, run.bucket_cap_mb)
        if args.overlap is not None and not 0 <= args.overlap <= 1:
            raise ConfigError("--overlap", args.overlap, "a share from 0 to 1", "e.g. --overlap 1")
        for line in report(run, counts, link, hooks, costs, args.overlap, bucket_sizes):
            print(line)
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
