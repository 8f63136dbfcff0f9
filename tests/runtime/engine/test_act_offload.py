"""Activation offload (`ftpipe_runtime.engine.act_offload`): a stage's saved activations (or a
recomputing stage's inputs) parked on the host between its forward and its backward, fetched
one backward ahead. The reference is the same run without it: the values come back bit for
bit, so the losses and weights are the same bit for bit (fp32); the bytes parked on the
device during the forward-to-backward gap are counted by the hooks themselves."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from ftpipe_runtime import run
from ftpipe_runtime.engine.act_offload import ActivationOffload, offloaded_stages
from ftpipe_runtime.engine.dataflow import Planned
from ftpipe_runtime.schedules import Action
from ftpipe_runtime.spec.topology import Topology
from runtime_reference import checkpoint_params
from runtime_toy import STAGES, one_rank_plan, toy_plan

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# --- one stage, by hand: what is parked, what is freed, what comes back ---


def _net(device, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*layers, torch.nn.Tanh()).to(device)


def _gpipe(m: int) -> list[Planned]:
    """One stage's GPipe list: every forward, then the backwards in reverse."""
    acts = [Action("F", 0, mb) for mb in range(m)]
    return [Planned(a) for a in acts + [Action("B", 0, mb) for mb in reversed(range(m))]]


def _train(off: ActivationOffload, net, xs, on_park=None):
    """The GPipe list of `net` over the micro-batches `xs`, through `off`: (input grads,
    weight grads summed)."""
    net.zero_grad()
    leaves, outs, grads = {}, {}, {}
    for item in off.watch(_gpipe(len(xs))):
        a = item.action
        if a.kind == "F":
            x = leaves[a.mb] = xs[a.mb].clone().requires_grad_(True)
            with off.saving(0, a.mb, keep_graph=True):
                out = net(x)
            if on_park is not None:
                on_park(a.mb)
            outs[a.mb] = out
            off.park(0, a.mb, {"x": x}, {"y": out}, None, net)
            del out
        else:
            off.fetch(0, a.mb, {"x": leaves[a.mb]})
            outs.pop(a.mb).sum().backward()
            grads[a.mb] = leaves.pop(a.mb).grad
    return grads, [p.grad.clone() for p in net.parameters()]


def test_parked_tensors_leave_the_device_and_come_back_bit_for_bit():
    """Every tensor the forward saved that nothing else holds goes (its memory freed: no
    reference left on the "device" side), but the weights (a Linear saves its weight) and the
    stage's input and output stay; the gradients are those of the run without offload."""
    net, m = _net("cpu", 16), 4
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(m)]
    off = ActivationOffload("cpu", {0}, min_bytes=0)
    watched = {}

    def on_park(mb):  # the saved tensors, before park decides
        watched[mb] = [weakref.ref(s.device) for s in off._parcels[(0, mb)].saved.values()]

    grads, weight_grads = _train(off, net, xs, on_park)
    ref_grads, ref_weight_grads = _train(ActivationOffload("cpu"), net, xs)
    for mb in range(m):
        assert torch.equal(grads[mb], ref_grads[mb])
    for g, want in zip(weight_grads, ref_weight_grads, strict=True):
        assert torch.equal(g, want)
    stats = off.stats
    assert stats.parcels == m and stats.late == 0  # each fetched ahead (or kept)
    # Three micro-batches went to the host (the last one's backward came next: kept), each
    # with GELU's input and the second Linear's (8 x 16 floats); Tanh saved its output,
    # which the stage returns: held anyway, not parked.
    assert stats.offloaded_bytes == 3 * 2 * 8 * 16 * 4
    assert stats.kept_bytes == 2 * 8 * 16 * 4
    assert stats.device_bytes == stats.host_bytes == 0  # all fetched and handed over


def test_parked_device_memory_is_freed_after_the_forward():
    net = _net("cpu", 16)
    off = ActivationOffload("cpu", {0}, min_bytes=0)
    items = iter(off.watch(_gpipe(2)))
    next(items)  # F0: its backward is not next, so it goes
    x = torch.randn(8, 16).requires_grad_(True)
    with off.saving(0, 0, keep_graph=True):
        out = net(x)
    saved = off._parcels[(0, 0)].saved.values()
    refs = [weakref.ref(s.device) for s in saved]
    off.park(0, 0, {"x": x}, {"y": out}, None, net)
    alive = [r() for r in refs if r() is not None]
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}
    # Left: the Linears' transposed weights (views of the weights) and the output (Tanh
    # saved it; the stage returns it); gone: GELU's input and the second Linear's.
    assert len(refs) == 5 and len(alive) == 3
    assert sum(t is out for t in alive) == 1
    assert sum(t.untyped_storage().data_ptr() in weights for t in alive) == 2


def test_the_next_backwards_tensors_come_back_one_backward_ahead():
    """GPipe's backwards run in reverse: as B3 starts (its forward was the last: kept),
    micro-batch 2's tensors start coming back and 1's and 0's wait on the host; without
    the action list (no `watch`) nothing comes ahead and each backward waits for its own."""
    net, m = _net("cpu", 16), 4
    off = ActivationOffload("cpu", {0}, min_bytes=0)
    leaves, outs, seen = {}, {}, []
    for item in off.watch(_gpipe(m)):
        a = item.action
        if a.kind == "F":
            leaves[a.mb] = x = torch.randn(8, 16).requires_grad_(True)
            with off.saving(0, a.mb, keep_graph=True):
                outs[a.mb] = net(x)
            off.park(0, a.mb, {"x": x}, {"y": outs[a.mb]}, None, net)
        else:
            seen.append({mb: p.where for (_, mb), p in off._parcels.items()})
            off.fetch(0, a.mb, {"x": leaves[a.mb]})
            outs.pop(a.mb).sum().backward()
    assert seen == [
        {0: "host", 1: "host", 2: "coming", 3: "device"},
        {0: "host", 1: "coming", 2: "coming"},
        {0: "coming", 1: "coming"},
        {0: "coming"},
    ]
    assert off.stats.late == 0
    unwatched = ActivationOffload("cpu", {0}, min_bytes=0)
    x = torch.randn(8, 16).requires_grad_(True)
    with unwatched.saving(0, 0, keep_graph=True):
        out = net(x)
    unwatched.park(0, 0, {"x": x}, {"y": out}, None, net)
    unwatched.fetch(0, 0, {"x": x})
    assert unwatched.stats.late == 1 and unwatched.stats.offloaded_bytes > 0


def test_small_tensors_stay_and_nothing_is_parked_without_stages():
    net, xs = _net("cpu", 16), [torch.randn(8, 16) for _ in range(3)]
    small = ActivationOffload("cpu", {0}, min_bytes=8 * 16 * 4 + 1)
    _train(small, net, xs)
    assert small.stats.offloaded_bytes == 0 and small.stats.kept_bytes == 3 * 2 * 8 * 16 * 4
    none = ActivationOffload("cpu")
    items = _gpipe(3)
    assert none.watch(items) is items and none.report() is None


def test_the_plan_chooses_stages_unless_the_flag_takes_all():
    plan = toy_plan("two-ranks")
    assert offloaded_stages(Topology(plan), [0, 2], everything=False) == set()  # no field: none
    plan["stages"][2]["offload"] = {"optimizer": False, "activations": True}
    plan["stages"][1]["offload"] = {"optimizer": True, "activations": True}
    plan["stages"][0]["offload"] = {"optimizer": True}
    assert offloaded_stages(Topology(plan), [0, 2], everything=False) == {2}
    assert offloaded_stages(Topology(plan), [0, 2], everything=True) == {0, 2}


# --- runs on one rank, in this process: the bytes parked on the device drop ---

ARGV = ["--steps", "2", "--optimizer", "adamw", "--lr", "0.05", "-q"]
OFF = ["--offload-activations", "--offload-activations-min", "0"]
KEEP_ALL = ["--offload-activations", "--offload-activations-min", "1e9"]  # counted, all kept


@pytest.mark.parametrize(
    ("schedule", "recompute"), [("gpipe", True), ("gpipe", False), ("1f1b", False)]
)
def test_the_bytes_parked_on_the_device_drop(tmp_path, schedule, recompute):
    """The same run three times: without offload, with everything offloadable sent to the
    host, with everything kept on the device (the hooks count what they hold either way).
    The device's share of the forward-to-backward gap drops, by the micro-batches in flight
    less the two per stage the device holds (the one computed, the one coming back)."""
    plan = one_rank_plan(schedule, 8)
    plan["recompute"] = recompute  # the stages park their inputs, or autograd's tensors
    runs = {}
    for name, extra in (("plain", []), ("off", OFF), ("kept", KEEP_ALL)):
        argv = [*ARGV, *extra, "--checkpoint-dir", str(tmp_path / name)]
        runs[name] = run(plan, STAGES, argv)
    assert runs["off"]["losses"] == runs["kept"]["losses"] == runs["plain"]["losses"]
    assert runs["off"]["checksums"] == runs["plain"]["checksums"]
    assert "activation_offload" not in runs["plain"]
    (off,), (kept,) = runs["off"]["activation_offload"], runs["kept"]["activation_offload"]
    assert off["stages"] == [0, 1, 2, 3] and off["late"] == 0
    total = kept["kept_bytes"]  # everything the hooks parked, on the device
    assert kept["offloaded_bytes"] == 0 and off["kept_bytes"] + off["offloaded_bytes"] == total
    if schedule == "gpipe":  # 8 micro-batches in flight per stage, 2 on the device
        assert off["offloaded_bytes"] >= total * 3 / 4  # all but the last forward's
        assert off["peak_device_bytes"] <= kept["peak_device_bytes"] / 3
    else:  # on one rank fewer are in flight, and more backwards follow their forward
        assert off["offloaded_bytes"] > 0
        assert off["peak_device_bytes"] < kept["peak_device_bytes"]
    assert off["peak_host_bytes"] > 0 and off["device_bytes"] == off["host_bytes"] == 0


def test_the_plans_stages_alone_are_offloaded(tmp_path):
    plan = one_rank_plan("1f1b")
    for st in plan["stages"]:
        st["offload"] = {"optimizer": False, "activations": st["id"] in (1, 2)}
    argv = [*ARGV, "--offload-activations-min", "0"]
    offloaded = run(plan, STAGES, [*argv, "--checkpoint-dir", str(tmp_path / "a")])
    plan_without = one_rank_plan("1f1b")
    plain = run(plan_without, STAGES, [*ARGV, "--checkpoint-dir", str(tmp_path / "b")])
    (report,) = offloaded["activation_offload"]
    assert report["stages"] == [1, 2] and report["offloaded_bytes"] > 0
    assert offloaded["losses"] == plain["losses"]
    assert offloaded["checksums"] == plain["checksums"]


# --- 2 and 4 CPU ranks: the run with --offload-activations is the run without ---

STEPS = 3
RUN_ARGV = ["--steps", str(STEPS), "--data", "copy", "--optimizer", "adamw", "--lr", "0.05"]
RUN_ARGV += ["--clip", "0.5", "--save-every", str(STEPS)]


def _four_ranks(schedule: str) -> dict:
    plan = toy_plan("two-ranks", schedule)
    plan["gpus"] = 4
    for st in plan["stages"]:
        st["gpu"] = st["id"]
    return plan


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("schedule", "layout", "recompute"),
    [
        # stages 0-2 recompute from their parked inputs (ftpipe's too, below)
        pytest.param("gpipe", "two-ranks", True, marks=pytest.mark.exhaustive),  # make test-all
        ("1f1b", "two-ranks", False),  # every stage keeps its graph: autograd's tensors
        ("ftpipe", "two-ranks", True),  # weight versions set aside, a stage stepped alone
        pytest.param("1f1b", "four-ranks", True, marks=pytest.mark.exhaustive),
    ],
)
def test_offloaded_run_equals_the_run_without(run_pipeline, tmp_path, schedule, layout, recompute):
    plan = _four_ranks(schedule) if layout == "four-ranks" else toy_plan(layout, schedule)
    plan["recompute"] = recompute
    out = {}
    for name, extra in (("plain", []), ("offload", OFF)):
        ckpt, log = tmp_path / name, tmp_path / f"{name}.json"
        argv = [*RUN_ARGV, "--schedule", schedule, *extra]
        argv += ["--checkpoint-dir", str(ckpt), "--log-json", str(log)]
        codes, ranks = run_pipeline(plan, argv, name=name)
        assert codes == [0] * plan["gpus"], ranks.stderr()
        out[name] = (json.loads(log.read_text()), checkpoint_params(ckpt, STEPS, range(4)))
    (plain, weights), (offload, off_weights) = out["plain"], out["offload"]
    assert offload["losses"] == plain["losses"]
    assert off_weights.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(off_weights[name], value), name  # bit for bit
    reports = offload["activation_offload"]
    assert len(reports) == plan["gpus"]
    for rank, report in enumerate(reports):
        assert report["late"] == 0, rank  # every backward's tensors fetched ahead (or kept)
    # the loss stage under 1F1B runs each backward right after its forward: nothing to move
    assert sum(r["offloaded_bytes"] for r in reports) > 0


# --- on a GPU: the device's memory drops ---


@pytest.mark.cuda
@needs_gpu
def test_on_a_gpu_offload_lowers_the_peak_memory_with_the_same_gradients():
    """GPipe over 8 micro-batches of a stage that parks 64 MiB each (two 1024 x 8192 fp32
    tensors; wide enough that the copies keep up with the matmuls): with offload the device
    holds two micro-batches' worth (the one computed, the one coming back) instead of eight,
    through pinned buffers, a side stream and events."""
    device, m, width, rows = torch.device("cuda"), 8, 8192, 1024
    net = _net(device, width)
    xs = [torch.randn(rows, width, device=device) for _ in range(m)]

    def peak(off):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = _train(off, net, xs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, grads

    _train(ActivationOffload(device, {0}), net, xs)  # warm: kernels, pinned host memory
    plain_peak, (plain_x, plain_w) = peak(ActivationOffload(device))
    off = ActivationOffload(device, {0})
    off_peak, (off_x, off_w) = peak(off)
    for mb in range(m):
        assert torch.equal(off_x[mb], plain_x[mb])
    for g, want in zip(off_w, plain_w, strict=True):
        assert torch.equal(g, want)
    parked = 2 * rows * width * 4  # per micro-batch; the last one's is kept (B7 is next)
    assert off.stats.late == 0 and off.stats.offloaded_bytes == (m - 1) * parked
    # The inputs, outputs and input gradients stay on the device in both runs; the parked
    # tensors of 6 micro-batches do not (4 asked: the copies to the host may lag the
    # forwards, and a tensor's memory is reused only once its copy has read it).
    assert plain_peak - off_peak >= 4 * parked, (plain_peak, off_peak)
