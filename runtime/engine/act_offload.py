"""Activation offload (`--offload-activations`, or a plan's `stages[i].offload.activations`):
what a stage's forward keeps for its backward waits in host memory instead of on the device.

    off = ActivationOffload(device, stages={0, 2}, min_bytes=2**20)   # `of_run` for a run
    for item in off.watch(items): ...          # the rank's actions: sees where backwards come
    with off.saving(stage, mb, keep_graph):     # a forward: autograd's saved tensors caught
        out = module(**inputs)
    inputs = off.park(stage, mb, inputs, out, params, module)   # after it: to the host
    inputs = off.fetch(stage, mb, inputs)       # its backward: back on the device
    off.report()                                # bytes moved and the peaks parked where

What is parked: a stage that keeps its graph parks the tensors autograd saves during the
forward (`torch.autograd.graph.saved_tensors_hooks`); a stage that recomputes keeps no graph,
and parks the stage inputs the recompute starts from. Tensors that stay on the device anyway
are left there, as moving them would free nothing: the stage's weights and buffers (views of
them too, such as a transposed weight a matmul saved), a weight version set aside for it or
received from another stage, the stage's inputs while its graph holds them (autograd's
leaves) and its outputs (the backward's roots); so are tensors under `min_bytes` (1 MiB by
default: not worth a copy's fixed cost).

When: a forward's tensors go to the host as soon as it returns, unless this stage's next
backward is that micro-batch's (the last forward before GPipe's backwards, every forward of
1F1B's last stage): that round trip would only cost. They come back one backward ahead: as
a backward of the stage starts, the tensors of the stage's next backward in this rank's
action list start coming back (the lists are data: `watch` reads them ahead as far as that
next backward). So the device holds, per stage, the micro-batch being computed and the one
coming next, instead of every micro-batch in flight (1F1B's depth + 1, GPipe's all). A
split backward (zero-bubble schedules) keeps them on the device from its B to its W.

How: on CUDA through pinned host buffers and a side stream, non_blocking copies and events,
so compute waits on a copy only when its data is not there yet (the backward that needs it
waits on the copy's event, on the device, not the CPU); a copy's source is held for the
side stream (`record_stream`) until it is done. On the CPU the same code path makes plain
copies, with nothing to wait for. Values come back bit for bit, in their layout (the host
copy keeps a dense tensor's strides), so a run is the same with or without offload.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["ActivationOffload", "OffloadStats", "of_run", "offloaded_stages"]

MIN_BYTES = 2**20  # smaller saved tensors stay on the device (--offload-activations-min)


def offloaded_stages(topo, stages: Iterable[int], everything: bool) -> set[int]:
    """This rank's stages whose activations go to the host: all with `everything`
    (--offload-activations), else those the plan marks (`Topology.offload_activations`, from
    `stages[i].offload.activations`; a plan written before the field offloads nothing)."""
    stages = set(stages)
    return stages if everything else stages & topo.offload_activations


def of_run(
    config, topo, *, stages: Iterable[int], device, forward_only: Iterable[int] = ()
) -> ActivationOffload:
    """A run's offload (`config`: the run's `RunConfig`): the stages of its rank (`stages`)
    the flag or the plan name (a forward-only, frozen stage keeps nothing: none of its), on
    its device."""
    offloaded = offloaded_stages(topo, stages, config.offload_activations)
    weights = {t for t, info in topo.transfers.items() if info.weight}
    return ActivationOffload(
        device,
        offloaded - set(forward_only),
        min_bytes=int(config.offload_activations_min * 2**20),
        keep=weights,
    )


@dataclass
class OffloadStats:
    """Bytes of this rank's parked tensors (a parcel: one forward's), in all and at peak."""

    parcels: int = 0  # forwards parked
    offloaded_bytes: int = 0  # sent to the host, in all
    kept_bytes: int = 0  # left on the device (small, or its backward came next), in all
    device_bytes: int = 0  # parked on the device now (kept, or back from the host)
    host_bytes: int = 0  # parked on the host now
    peak_device_bytes: int = 0  # the most parked on the device at once
    peak_host_bytes: int = 0
    late: int = 0  # backwards whose tensors were still on the host (not fetched ahead)

    def add(self, *, device: int = 0, host: int = 0) -> None:
        self.device_bytes += device
        self.host_bytes += host
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)


class _Saved:
    """One parked tensor: on the device (`device`), or its copy on the host (`host`)."""

    __slots__ = ("device", "grad", "host")

    def __init__(self, t: torch.Tensor, grad: bool = False):
        self.device, self.host, self.grad = t, None, grad


@dataclass
class _Parcel:
    """What one forward (stage, micro-batch) parked."""

    graph: bool = False  # the forward kept its graph (else: it is recomputed from its inputs)
    saved: dict[int, _Saved] = field(default_factory=dict)  # id(tensor) -> autograd's
    inputs: dict[str, _Saved] = field(default_factory=dict)  # a recompute's stage inputs
    moving: list[_Saved] = field(default_factory=list)  # those that go to the host
    kept: int = 0  # bytes parked on the device throughout
    moved: int = 0  # bytes of `moving`
    where: str = "device"  # of `moving`: "device", "host", "coming" (back, not waited for)
    event: object = None  # the last copy's (CUDA)


class _Copier:
    """Copies between the device and the host: on CUDA pinned buffers and a side stream,
    on the CPU plain copies (nothing to wait for)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @torch.no_grad()  # copies of values: no part of any graph
    def down(self, tensors: list[torch.Tensor]):
        """(host copies, the event they are done at)."""
        if not self.cuda:
            return [torch.empty_like(t, device="cpu").copy_(t) for t in tensors], None
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # after the forward made them
        hosts = []
        with torch.cuda.stream(side):
            for t in tensors:
                hosts.append(torch.empty_like(t, device="cpu", pin_memory=True))
                hosts[-1].copy_(t, non_blocking=True)
                t.record_stream(side)  # its memory is not reused before the copy read it
            done = torch.cuda.Event()
            done.record(side)
        return hosts, done

    @torch.no_grad()
    def up(self, hosts: list[torch.Tensor]):
        """(device copies, the event they are done at): allocated on the compute stream,
        which uses them, and written by the side stream once that stream's earlier work,
        the last use of the memory they reuse, is done."""
        if not self.cuda:
            return [torch.empty_like(h, device=self.device).copy_(h) for h in hosts], None
        side = self.stream
        outs = [torch.empty_like(h, device=self.device) for h in hosts]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for out, h in zip(outs, hosts, strict=True):
                out.copy_(h, non_blocking=True)  # pinned: the allocator holds h until done
            done = torch.cuda.Event()
            done.record(side)
        return outs, done

    def wait(self, event) -> None:
        """The compute stream waits for `event` (on the device; the CPU goes on)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class _Ahead:
    """A rank's actions (`Planned` items), read ahead of the one running as far as asked."""

    def __init__(self, items: Iterable):
        self._items, self._buf, self._base = iter(items), deque(), 0
        self._found: dict[int, tuple[int, int]] = {}  # stage -> (scanned from, its B there)

    def at(self, i: int):
        """The i-th item (None past the end); earlier ones than the last `forget` are gone."""
        while self._base + len(self._buf) <= i:
            item = next(self._items, None)
            if item is None:
                return None
            self._buf.append(item)
        return self._buf[i - self._base]

    def forget(self, i: int) -> None:
        """Items before the i-th will not be asked for again."""
        while self._base < i and self._buf:
            self._buf.popleft()
            self._base += 1

    def next_backward(self, stage: int, start: int) -> int | None:
        """The micro-batch of the first backward (B) of `stage` at position `start` or later."""
        hit = self._found.get(stage)
        if hit is not None and hit[0] <= start <= hit[1]:
            pos = hit[1]  # no B of the stage between where that scan started and there
        else:
            pos = start
            while (item := self.at(pos)) is not None and not _is_backward(item.action, stage):
                pos += 1
            self._found[stage] = (start, pos)
        item = self.at(pos)
        return None if item is None else item.action.mb


def _is_backward(action, stage: int) -> bool:
    return action.kind == "B" and action.stage == stage


class ActivationOffload:
    """One rank's activation offload (see the module doc); with no stages, it does nothing.
    `keep`: stage inputs that stay where they are (weights received from another stage: one
    value read by many micro-batches)."""

    def __init__(self, device, stages: Iterable[int] = (), *, min_bytes: int = MIN_BYTES, keep=()):
        self.device = _indexed(torch.device(device))
        self.stages = frozenset(stages)
        self.min_bytes, self.keep = min_bytes, frozenset(keep)
        self.stats = OffloadStats()
        self._copier = _Copier(self.device) if self.stages else None
        self._parcels: dict[tuple[int, int], _Parcel] = {}
        self._ahead: _Ahead | None = None
        self._now = -1  # the position of the action running (in `watch`'s items)

    # --- the rank's actions ---
    def watch(self, items: Iterable) -> Iterable:
        """The rank's actions, as given; before a backward of an offloaded stage runs, the
        tensors of that stage's next backward start coming back."""
        return self._watched(items) if self.stages else items

    def _watched(self, items: Iterable) -> Iterator:
        self._ahead = ahead = _Ahead(items)
        i = 0
        while (item := ahead.at(i)) is not None:
            ahead.forget(i)
            self._now, a = i, item.action
            if a.kind == "B" and a.stage in self.stages:
                now = self._parcels.get((a.stage, a.mb))  # first in line, if it is not there
                later = self._parcels.get((a.stage, ahead.next_backward(a.stage, i + 1)))
                for parcel in (now, later):
                    if parcel is not None:
                        self.stats.late += parcel is now and parcel.where == "host"
                        self._bring(parcel)
            yield item
            i += 1

    # --- a forward ---
    def saving(self, stage: int, mb: int, keep_graph: bool):
        """Around a forward that keeps its graph: autograd's saved tensors go into the parcel
        of (stage, mb), and the graph holds handles to them."""
        if stage not in self.stages or not keep_graph:
            return contextlib.nullcontext()
        parcel = self._parcels[(stage, mb)] = _Parcel(graph=True)
        return torch.autograd.graph.saved_tensors_hooks(self._packer(parcel), self._unpack)

    def _packer(self, parcel: _Parcel):
        def pack(t: torch.Tensor):
            held = t.requires_grad and t.is_leaf  # a weight or a stage input: held anyway
            if held or t.device != self.device or t.layout != torch.strided:
                return t
            saved = parcel.saved.get(id(t))  # saved twice (x * x): one copy
            if saved is None:
                saved = parcel.saved[id(t)] = _Saved(t)
            return saved

        return pack

    def park(self, stage: int, mb: int, inputs: dict, out: dict, params, module) -> dict:
        """After the forward of (stage, mb): its parcel to the host (see the module doc).
        Returns the stage inputs to keep for the backward (a recompute's parked ones None)."""
        if stage not in self.stages:
            return inputs
        parcel = self._parcels.setdefault((stage, mb), _Parcel())
        if parcel.graph:  # what autograd saved, but what stays on the device anyway
            alive = _storages(module.parameters(), module.buffers(), inputs.values(),
                              out.values(), (params or {}).values())  # fmt: skip
            found = [s for s in parcel.saved.values() if _storage(s.device) not in alive]
        else:  # a recompute's stage inputs
            found = [
                parcel.inputs.setdefault(name, _Saved(t, grad=t.requires_grad))
                for name, t in inputs.items()
                if name not in self.keep and t.device == self.device and t.layout == torch.strided
            ]
        parcel.moving = [s for s in found if _nbytes(s.device) >= self.min_bytes]
        parcel.moved = sum(_nbytes(s.device) for s in parcel.moving)
        parcel.kept = sum(_nbytes(s.device) for s in found) - parcel.moved
        parcel.inputs = {n: s for n, s in parcel.inputs.items() if s in parcel.moving}
        ahead = self._ahead
        if ahead is not None and ahead.next_backward(stage, self._now + 1) == mb:
            parcel.kept, parcel.moved, parcel.moving = parcel.kept + parcel.moved, 0, []
            parcel.inputs = {}  # its backward comes next: it stays
        self.stats.parcels += 1
        self.stats.kept_bytes += parcel.kept
        self.stats.offloaded_bytes += parcel.moved
        self.stats.add(device=parcel.kept, host=parcel.moved)
        if not parcel.moving:
            return inputs
        hosts, parcel.event = self._copier.down([s.device for s in parcel.moving])
        for saved, host in zip(parcel.moving, hosts, strict=True):
            saved.host, saved.device = host, None
        parcel.where = "host"
        return {n: None if n in parcel.inputs else t for n, t in inputs.items()}

    # --- its backward ---
    def fetch(self, stage: int, mb: int, inputs: dict) -> dict:
        """Before the backward of (stage, mb): its parcel on the device (waited for there);
        returns the stage inputs with a recompute's parked ones back, leaves again."""
        parcel = self._parcels.pop((stage, mb), None)
        if parcel is None:
            return inputs
        self.stats.late += parcel.where == "host"  # not fetched ahead (`watch` was not used)
        self._bring(parcel)
        self._copier.wait(parcel.event)
        self.stats.add(device=-(parcel.kept + parcel.moved))
        if not parcel.inputs:
            return inputs
        back = dict(inputs)
        for name, saved in parcel.inputs.items():
            back[name] = saved.device.requires_grad_(saved.grad)
        return back

    def _bring(self, parcel: _Parcel) -> None:
        """Start the parcel's copy back to the device (if it is on the host)."""
        if parcel.where != "host":
            return
        devices, parcel.event = self._copier.up([s.host for s in parcel.moving])
        for saved, t in zip(parcel.moving, devices, strict=True):
            saved.device, saved.host = t, None
        parcel.where = "coming"
        self.stats.add(device=parcel.moved, host=-parcel.moved)

    def _unpack(self, saved):
        """A saved tensor for autograd: the parked one, on the device (`fetch` brought it)."""
        if not isinstance(saved, _Saved):
            return saved
        if saved.device is None:  # a backward that skipped `fetch`: back now, waited for
            devices, done = self._copier.up([saved.host])
            self._copier.wait(done)
            saved.device, saved.host = devices[0], None
        return saved.device

    def report(self) -> dict | None:
        """The stats, for the run's summary (None: nothing offloaded on this rank)."""
        if not self.stages:
            return None
        return {"stages": sorted(self.stages), "min_bytes": self.min_bytes, **asdict(self.stats)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(*groups) -> set[int]:
    return {_storage(t) for group in groups for t in group if isinstance(t, torch.Tensor)}


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the tensors made there say it (`cuda:0`): the forward's tensors are compared
    with it, and torch.device("cuda") equals no tensor's device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
