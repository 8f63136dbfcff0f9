"""Host memory and the host link: where a plan's offloaded stages keep their state, and what
moving it costs.

    host = Host.of(hardware_json, gpu_memory=24 * 2**30, gpus_per_node=8)  # defaults filled
    host.share(offloading=4)            # (link bytes/s, CPU step bytes/s) of one GPU of 4
    host_param_bytes((4096, 4096), "bfloat16", "adamw", PRECISIONS["bf16"])   # 18 B a weight
    Offload(optimizer=True, activations=False)          # what one stage offloads
    Offload(optimizer=True, gradients="device")         # its gradients summed on the GPU
    host_memory(plan)                   # node -> host bytes its offloaded stages hold

A hardware file's `host` section describes the machine its GPUs sit in (its node):

- `memory_bytes`: host memory of one node (default: twice its GPUs' memory together);
- `link_bandwidth`: bytes/s each way between one GPU and host memory (PCIe; default 12e9,
  PCIe 3.0 x16 as the hardware files count it);
- `node_bandwidth`: bytes/s the node's GPUs reach to host memory together: GPUs behind one
  PCIe switch share its uplink, and all share the CPUs' root complex and memory (default:
  `link_bandwidth` x half the node's GPUs, rounded up: GPUs in pairs behind switches);
- `step_bandwidth`: bytes/s the node's CPUs pass over in an optimizer step of host-held
  parameters: each element's master weight, summed gradient and optimizer state, read and
  written once (torch's AdamW on CPU tensors, fused; AdamW in fp32: 16 bytes an element, 8 of
  them its state) — `python -m benchmarks.calibrate` measures it (default 10e9);
- `sum_bandwidth`: bytes/s the node's CPUs pass over adding a landed gradient into its fp32
  sum (the landing buffer read, the sum read and written), and converting a stepped fp32
  master into its 16-bit weight before the copy back (default: `step_bandwidth`);
- `device_is_host`: the "GPU" is the host's CPU (a CPU rank): what is offloaded stays in the
  same memory, so the rank's memory counts it (`gpu_memory.GpuMemory.host`).

Sharing: a GPU's share of the node's link and CPUs is `share(offloading)`, the node's figure
divided among the GPUs of the node that offload something (its own link's at most), as if
they all streamed at once. That is the bound the planner needs (they do stream at once under
a synchronous schedule's step) and keeps the simulation free of cross-GPU contention events.

What a stage offloads (`Offload`, the plan's per-stage `offload`):
- optimizer: fp32 masters, optimizer state, the summed gradient and a landing buffer per
  trainable tensor on the host (`host_param_bytes`, as `ftpipe_runtime.train.offload`'s doc
  counts them); the GPU keeps the weights it computes with and each gradient until its copy
  is issued;
- optimizer with `gradients="device"` (`Offload.sums_on_device`): the gradients are summed on
  the GPU in the master's dtype (`device_sum_bytes`: 4 bytes an element under mixed
  precision, held throughout) and copied to the host once a step, at the stage's S, into
  the master's gradient: no landing buffer on the host, nothing summed there, and the link
  carries the sum (4 bytes an element) once a step instead of each micro-batch's gradients
  (the weights' bytes, m times);
- activations: what the stage keeps between a micro-batch's forward and its backward (its
  activations, or its inputs where it recomputes) on the host after the forward, fetched
  back one micro-batch ahead of its backward: the GPU keeps at most `ACTIVATIONS_ON_GPU`
  micro-batches' (the one in flight and the one prefetched), the host the rest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
from ftpipe_runtime.schedules import resolve_schedule
from ftpipe_runtime.spec.plan import Offload  # the plan's record; its costs here
from ftpipe_runtime.train.offload import may_lag

from .formulas import ACTIVATIONS_ON_GPU, PRECISIONS, Precision, optimizer_state_elements

__all__ = [
    "ACTIVATIONS_ON_GPU",
    "DEFAULT_LINK_BANDWIDTH",
    "DEFAULT_STEP_BANDWIDTH",
    "Host",
    "Offload",
    "OptimizerTimes",
    "host_memory",
    "host_clip_bytes",
    "host_param_bytes",
    "host_step_bytes",
    "device_sum_bytes",
    "host_sum_bytes",
    "lands",
    "upload_convert_bytes",
    "nodes_of",
    "optimizer_times",
    "stage_device_sum_bytes",
    "stage_host_bytes",
    "sums_apart",
]

DEFAULT_LINK_BANDWIDTH = 12e9  # PCIe 3.0 x16, as the hardware files count it (rtx2080ti)
DEFAULT_STEP_BANDWIDTH = 10e9  # a round figure below this 2-core machine's measured rate
DEFAULT_MEMORY_PER_GPU = 2  # host memory: twice the node's GPU memory


NONE = Offload()


@dataclass(frozen=True)
class Host:
    """A node's host memory, its GPUs' link to it and its CPUs' optimizer step (see the
    module doc); every figure resolved (no zeros) by `of`."""

    memory_bytes: int = 0  # per node
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH  # per GPU, each way
    node_bandwidth: float = 0.0  # all the node's GPUs together
    step_bandwidth: float = DEFAULT_STEP_BANDWIDTH  # the node's CPUs, optimizer step
    sum_bandwidth: float = DEFAULT_STEP_BANDWIDTH  # the node's CPUs, gradient sums
    gpus_per_node: int = 1
    device_is_host: bool = False

    @classmethod
    def of(cls, d: dict | None, gpu_memory: int, gpus_per_node: int) -> Host:
        """The `host` section `d` of a hardware file with the documented defaults filled in
        for a node of `gpus_per_node` GPUs of `gpu_memory` bytes; a figure that is not a
        positive number is one sentence."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)} - {"gpus_per_node", "device_is_host"}
        for k in names & set(d):
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"host {k} must be a positive number, not {v!r:.40}")
            if not math.isfinite(v):
                raise ValueError(f"host {k} must be finite, not {v!r}")
        n = max(1, int(gpus_per_node))
        link = float(d.get("link_bandwidth", DEFAULT_LINK_BANDWIDTH))
        step = float(d.get("step_bandwidth", DEFAULT_STEP_BANDWIDTH))
        return cls(
            memory_bytes=int(d.get("memory_bytes", DEFAULT_MEMORY_PER_GPU * gpu_memory * n)),
            link_bandwidth=link,
            node_bandwidth=float(d.get("node_bandwidth", link * math.ceil(n / 2))),
            step_bandwidth=step,
            sum_bandwidth=float(d.get("sum_bandwidth", step)),
            gpus_per_node=n,
            device_is_host=bool(d.get("device_is_host", False)),
        )

    def share(self, offloading: int) -> tuple[float, float, float]:
        """(link bytes/s, step bytes/s, sum bytes/s) of one GPU when `offloading` GPUs of its
        node offload something: the node's figures divided among them, the link at most
        its own."""
        k = max(1, offloading)
        link = min(self.link_bandwidth, self.node_bandwidth / k)
        return link, self.step_bandwidth / k, self.sum_bandwidth / k

    def node_of(self, gpu: int) -> int:
        """The node of a pipeline's GPU when the plan names no cluster: nodes filled in order."""
        return gpu // self.gpus_per_node

    def to_json(self) -> dict:
        return asdict(self)


def _size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def host_param_bytes(
    shape, dtype: str, optimizer: str, precision: Precision, *, on_device: bool = False,
    overlapped: bool = False, summed_apart: bool = False,
) -> int:  # fmt: skip
    """Host bytes of one trainable parameter whose optimizer is offloaded, as
    `ftpipe_runtime.train.offload` keeps it: its master (fp32 under mixed precision for a
    tensor in the compute dtype, else the tensor's own dtype), the optimizer's state (made
    like the master), the summed gradient (the master's dtype) and, unless its gradients
    are summed `on_device`, the landing buffer (the gradient's dtype: the weight's), which
    also stages the new weight for its copy back; summed on the device, a staging buffer of
    its own where the master's dtype is not the weight's (`HostOffload._staged`).
    `overlapped` (the CPU step beside the rank's next actions, `HostOffload.launch`), streamed:
    a staging buffer of its own; `summed_apart` (the next step's gradients may arrive while
    the step runs: `sums_apart`), their sum beside the one the step reads.
    `host_param_bytes((8, 8), "bfloat16", "adamw", bf16)` -> 64 x (4 + 8 + 4 + 2)."""
    numel = math.prod(shape)
    weight = _size(getattr(torch, dtype))
    master = _master_size(dtype, precision)
    state = optimizer_state_elements(tuple(shape), optimizer) * master
    landing = weight if not on_device or master != weight else 0
    streamed = overlapped and not on_device
    staging = weight if streamed and master != weight else 0
    apart = master if streamed and summed_apart else 0
    return numel * (master + master + landing + staging + apart) + state


def sums_apart(plan) -> frozenset[int]:
    """Stages whose next step's gradients may arrive while their overlapped CPU step still
    reads the last one's sum: `HostOffload._add` sums them apart until the step lands, the
    two sums then held together. The schedule says where that can happen: a backward of the
    stage (its W, split) between its S and the action that lands the step. The executor
    lands it where the stage next runs on its live weights or steps (`lands`). None under a
    synchronous schedule (the next forward lands it) nor under FTPipe's policies (a stage
    with micro-batches in flight recomputes; one without runs its next forward first). Where
    such a backward comes (2BW's, on the older version), its gradient meets the step's sum
    only if the CPU step still runs then: timing, which the simulator sees
    (`simulate.host.HostTraffic.apart`) and the plan alone counts. `Plan.sums_apart` keeps
    the answer."""
    streamed = {s.id for s in plan.stages if s.offload.optimizer and not s.offload.sums_on_device}
    sched = resolve_schedule(plan.schedule, plan.recompute)
    if plan.replicas > 1 or not streamed or sched.synchronous:
        return frozenset()
    policies, m = plan.policies, plan.micro_batches
    lags = {s.id for s in plan.stages if s.offload.lagged and may_lag(policies[s.id])}
    ahead = max((p.in_flight for p in policies.values()), default=0)
    lists = sched.actions(plan.stage_infos(), m, 2 + -(-ahead // m))  # a step and its next
    split = {a.stage for acts in lists.values() for a in acts if a.kind == "W"}
    out = set()
    for acts in lists.values():
        pending: dict[int, int] = {}  # stage -> the step whose CPU step has not landed
        for a in acts:
            s = a.stage
            if s not in streamed:
                continue
            if s in pending:
                if lands(a, policies[s], m, pending[s], lagged=s in lags):
                    del pending[s]
                elif a.kind == ("W" if s in split else "B"):
                    out.add(s)
            if a.kind == "S":
                pending[s] = a.mb
    return frozenset(out)


def lands(a, policy, m: int, step: int, *, lagged: bool = False) -> bool:
    """Does action `a` of a stage whose overlapped CPU step of `step` has not landed land it,
    as the executor does? Its next S does; so, unless the stage is lagged, does a forward or
    a recomputing backward on the live weights (`Executor._call`: no version pinned, or one
    newer than `step`'s inputs); a backward through a kept graph does not, nor an action on
    a set-aside older version (2BW's, WPipe's)."""
    if a.kind == "S":
        return True
    if lagged or not (a.kind == "F" or a.recompute):
        return False
    v = policy.version(a.mb, m)
    return v is None or v > step


def device_sum_bytes(shape, dtype: str, precision: Precision) -> int:
    """GPU bytes of one offloaded parameter's gradient sum where its stage sums on the device
    (`Offload.sums_on_device`): the master's dtype, 4 bytes an element under mixed precision."""
    return math.prod(shape) * _master_size(dtype, precision)


def _master_size(dtype: str, precision: Precision) -> int:
    """Bytes of an element of a parameter's master (and of its summed gradient)."""
    return 4 if precision.master and dtype == precision.compute else _size(getattr(torch, dtype))


def host_step_bytes(shape, dtype: str, optimizer: str, precision: Precision) -> int:
    """What the CPU's step of one offloaded parameter passes over: master, summed gradient
    and optimizer state (the landing buffer is not read by it)."""
    master = _master_size(dtype, precision)
    return (
        math.prod(shape) * 2 * master + optimizer_state_elements(tuple(shape), optimizer) * master
    )


def host_clip_bytes(shape, dtype: str, precision: Precision) -> int:
    """What clipping one offloaded parameter's summed gradient passes over on the host before
    the step (the runtime's default `--clip 1.0`): read for the norm, read and written for the
    scale. On the H200's host it took 0.5 s a step for a 1B model, more than the AdamW step's
    0.34 s (docs/gpu-check.md, where the offloaded step's time goes)."""
    return math.prod(shape) * 3 * _master_size(dtype, precision)


def upload_convert_bytes(shape, dtype: str, precision: Precision) -> int:
    """What converting one stepped master into its weight's dtype passes over on the host
    before the copy back (the master read, the staging buffer written): nothing where the
    master is in the weight's dtype already."""
    weight, master = _size(getattr(torch, dtype)), _master_size(dtype, precision)
    return 0 if weight == master else math.prod(shape) * (weight + master)


def host_sum_bytes(shape, dtype: str, precision: Precision) -> int:
    """What adding one landed gradient into its sum passes over on the host: the landing
    buffer read, the sum read and written."""
    weight = _size(getattr(torch, dtype))
    return math.prod(shape) * (weight + 2 * _master_size(dtype, precision))


def _precision(plan) -> Precision:
    return PRECISIONS[plan.model.get("precision") or "fp32"]


def stage_host_bytes(plan, stage, in_flight: int | None = None, apart=None) -> int:
    """Host bytes of what `stage` of `plan` offloads: its trainable parameters' masters,
    state, sums and landing buffers (optimizer), and what it keeps for the backwards of its
    micro-batches in flight beyond the `ACTIVATIONS_ON_GPU` the GPU holds (activations;
    `in_flight`: the simulator's peak, else the schedule's). `apart`: the stages whose
    second gradient sum the simulator saw held beside the step's (its timing), else those
    whose schedule may make one (`sums_apart`)."""
    off = stage.offload
    total = 0
    # Overlapped wherever one replica steps it (`simulate.host.overlapped`; a GPU that sends
    # its weights at a synchronous step does not, and is counted as if it did: a bound).
    overlaps = plan.replicas == 1
    if off.optimizer:
        summed_apart = overlaps and stage.id in (plan.sums_apart if apart is None else apart)
        precision, params = _precision(plan), {p.name: p for p in plan.params}
        for name in stage.params:
            p = params[name]
            if p.trainable:
                total += host_param_bytes(
                    p.shape, p.dtype, plan.optimizer, precision, on_device=off.sums_on_device,
                    overlapped=overlaps, summed_apart=summed_apart,
                )  # fmt: skip
    if off.activations and not stage.forward_only:
        policy = plan.policies[stage.id]
        n = policy.in_flight if in_flight is None else in_flight
        kept = stage.input_bytes if policy.recompute else stage.act_bytes
        total += max(0, n - ACTIVATIONS_ON_GPU) * kept
    return total


@dataclass(frozen=True)
class OptimizerTimes:
    """What offloading one stage's optimizer costs on a GPU's share of its node's host (as
    `ftpipe_runtime.train.offload` runs it): each micro-batch's gradients copied down and
    summed on the host (`grad_s`), the CPU's clip and step (`cpu_s`), the new weights converted
    to their dtype on the host and copied back (`upload_s`: `up_bytes`, the weights' bytes,
    over the link; `upload_convert_bytes` over the CPUs at `sum_bandwidth`); `grad_bytes`: one micro-batch's gradients
    (the weights' bytes). Summed
    on the device (`Offload.sums_on_device`): no `grad_s`, `grad_bytes` 0, and at the step
    the sums copied down once (`sum_s`, `sum_bytes`) before the CPU steps."""

    grad_s: float
    cpu_s: float
    upload_s: float
    grad_bytes: int
    up_bytes: int
    sum_s: float = 0.0
    sum_bytes: int = 0

    @property
    def step_s(self) -> float:
        """What the stage's S spends on the host: the sums down, the CPU step, weights up."""
        return self.sum_s + self.cpu_s + self.upload_s

    def per_step_s(self, m: int) -> float:
        """Host seconds a step of m micro-batches adds to the stage's GPU list."""
        return m * self.grad_s + self.step_s


def optimizer_times(plan, stage, share: tuple[float, float, float]) -> OptimizerTimes:
    """`stage`'s `OptimizerTimes` at `share` = (link, step, sum bytes/s: `Host.share`)."""
    link, step_bw, sum_bw = share
    precision, params = _precision(plan), {p.name: p for p in plan.params}
    owned = [params[n] for n in stage.params if params[n].trainable]
    nbytes = sum(p.bytes for p in owned)
    stepped = sum(
        host_step_bytes(p.shape, p.dtype, plan.optimizer, precision)
        + host_clip_bytes(p.shape, p.dtype, precision)
        for p in owned
    )
    upload = (
        nbytes / link
        + sum(upload_convert_bytes(p.shape, p.dtype, precision) for p in owned) / sum_bw
    )
    if stage.offload.sums_on_device:
        sums = sum(device_sum_bytes(p.shape, p.dtype, precision) for p in owned)
        return OptimizerTimes(0.0, stepped / step_bw, upload, 0, nbytes, sums / link, sums)
    summed = sum(host_sum_bytes(p.shape, p.dtype, precision) for p in owned)
    return OptimizerTimes(
        nbytes / link + summed / sum_bw, stepped / step_bw, upload, nbytes, nbytes
    )


def stage_device_sum_bytes(plan, stage) -> int:
    """GPU bytes of `stage`'s gradient sums where it offloads its optimizer and sums its
    gradients on the device (0 otherwise)."""
    if not stage.offload.sums_on_device:
        return 0
    precision, params = _precision(plan), {p.name: p for p in plan.params}
    owned = [params[n] for n in stage.params if params[n].trainable]
    return sum(device_sum_bytes(p.shape, p.dtype, precision) for p in owned)


def lagged(plan):
    """`plan` with each offloaded stage's step landing at its next S (`Offload.step`
    "lagged") where its schedule allows it (`may_lag`: FTPipe's); every other stage as it is
    (`--offload-step lagged`)."""
    policies = plan.policies
    return plan.with_(
        stages=tuple(
            replace(s, offload=replace(s.offload, step="lagged"))
            if s.offload.optimizer and may_lag(policies[s.id])
            else s
            for s in plan.stages
        )
    )


def nodes_of(plan) -> dict[int, list[int]]:
    """Node -> the pipeline GPUs of its ranks (a GPU once per replica on it): the plan's
    cluster's nodes, else nodes of `host.gpus_per_node` filled in rank order."""
    per_node = plan.cluster.gpus_per_node if plan.cluster else plan.host.gpus_per_node
    out: dict[int, list[int]] = {}
    for rank, (_, g) in enumerate(plan.placed()):
        out.setdefault(rank // max(1, per_node), []).append(g)
    return out


def host_memory(plan, in_flight: dict[int, int] | None = None, apart=None) -> dict[int, int]:
    """Node -> host bytes its ranks' offloaded stages hold (`stage_host_bytes`)."""
    per_gpu = {g: 0 for g in range(plan.gpus)}
    for s in plan.stages:
        n = None if in_flight is None else in_flight[s.id]
        per_gpu[s.gpu] += stage_host_bytes(plan, s, n, apart)
    return {node: sum(per_gpu[g] for g in gpus) for node, gpus in nodes_of(plan).items()}
