"""Host offload's memory model (`ftpipe_compiler.costs.host`): the bytes a stage puts on the
host against what the runtime's offload (`ftpipe_runtime.train.offload`) actually allocates
there, what the GPU keeps (`formulas.stage_memory`), and the hardware files' host section."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest
import torch
from ftpipe_runtime.schedules import StagePolicy
from ftpipe_runtime.train.offload import HostOffload
from ftpipe_runtime.train.optim import make_optimizer
from ftpipe_runtime.train.precision import MixedPrecision, get_precision

from ftpipe_compiler.costs.formulas import PRECISIONS, param_bytes, stage_memory
from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.costs.host import (
    Host,
    Offload,
    device_sum_bytes,
    host_param_bytes,
    optimizer_times,
)
from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.resources import config_names, load_config

SHAPES = [(6, 5), (5,), (3, 5)]


def _offloaded_bytes(precision: str, optimizer: str, on_device: bool = False):
    """(host bytes, device gradients left beyond the weights, device sums' bytes) after a
    backward, its landing and a step of a small module offloaded by the runtime: every tensor
    it holds, counted by storage."""
    torch.manual_seed(0)
    p = get_precision(precision)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3, bias=False)).to(p.dtype)
    host = HostOffload("cpu", on_device={0} if on_device else ())
    mixed = MixedPrecision(p, {0: net}, offload=host)
    opt = make_optimizer(optimizer, [t for _, t in mixed.trainable(0)], 0.01)
    for _ in range(2):  # two micro-batches: the landing buffer reused, the sum added to
        net(torch.randn(4, 6).to(p.dtype)).sum().backward()
    mixed.settle(0)
    opt.step()
    mixed.after_step(0)  # the new weights staged in their dtype and copied back
    held = []
    for _, master in mixed.trainable(0):
        held += [master, master.grad]
        held += [v for v in opt.state[master].values() if v.numel() == master.numel()]
    held += list(host._buffers.values())
    device = [w.grad for w in net.parameters() if w.grad is not None]
    sums = sum(t.numel() * t.element_size() for t in host._sums.values())
    return sum(t.numel() * t.element_size() for t in held), len(device), sums


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_host_bytes_are_what_the_runtime_allocates(precision, optimizer):
    """Master, summed gradient, optimizer state and landing buffer per trainable element, as
    the runtime's offload holds them (bf16 AdamW: 4 + 4 + 8 + 2 = 18 B); nothing of them left
    on the device (no gradient kept there)."""
    got, device_grads, _ = _offloaded_bytes(precision, optimizer)
    compute = get_precision(precision).compute
    want = sum(host_param_bytes(s, compute, optimizer, PRECISIONS[precision]) for s in SHAPES)
    assert got == want
    assert device_grads == 0
    numel = sum(math.prod(s) for s in SHAPES)
    if (precision, optimizer) == ("bf16", "adamw"):
        assert want == 18 * numel


@pytest.mark.parametrize("meanwhile", [2, 0])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_an_overlapped_step_holds_what_the_model_adds(precision, meanwhile):
    """Overlapped (`HostOffload.launch`): the new weights staged in a buffer of their own, and
    where the next micro-batches' backwards come while the step reads its gradients' sum (an
    asynchronous schedule: `summed_apart`), their sum apart (bf16 AdamW: 18 + 2 + 4 = 24 B
    an element; fp32: 20 + 4, no staging). Under a synchronous one none come: 20 B in both."""
    torch.manual_seed(0)
    p = get_precision(precision)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3, bias=False)).to(p.dtype)
    host = HostOffload("cpu")
    mixed = MixedPrecision(p, {0: net}, offload=host)
    opt = make_optimizer("adamw", [t for _, t in mixed.trainable(0)], 0.01)
    net(torch.randn(4, 6).to(p.dtype)).sum().backward()
    mixed.settle(0)
    stepped = [master.grad for _, master in mixed.trainable(0)]  # what the step reads
    gate = threading.Event()
    mixed.launch(0, lambda: (gate.wait(10), opt.step()))
    for _ in range(meanwhile):  # the next step's micro-batches, while the step is held
        net(torch.randn(4, 6).to(p.dtype)).sum().backward()
    gate.set()
    host._inflight[0].result()  # stepped and staged, not landed
    held = [*stepped, *(t for _, t in host._next.get(0, {}).values())]
    for _, master in mixed.trainable(0):
        held += [master, *(v for v in opt.state[master].values() if v.numel() == master.numel())]
    held += [*host._buffers.values(), *host._staging.values()]
    got = sum(t.untyped_storage().nbytes() for t in {t.data_ptr(): t for t in held}.values())
    compute = get_precision(precision).compute
    want = sum(
        host_param_bytes(
            s, compute, "adamw", PRECISIONS[precision], overlapped=True, summed_apart=meanwhile > 0
        )
        for s in SHAPES
    )
    assert got == want
    numel = sum(math.prod(s) for s in SHAPES)
    if precision in ("bf16", "fp32"):
        assert want == (24 if meanwhile else 20) * numel
    mixed.land(0)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_summed_on_the_device_the_gpu_holds_the_sums_the_host_only_a_staging_buffer(precision):
    """Gradients summed on the device: the runtime's sums there are `device_sum_bytes` (fp32,
    4 B an element, under bf16; bf16 under bf16-pure), its host tensors `host_param_bytes`
    with no landing buffer but, where the master's dtype is not the weight's, the buffer the
    new weights are converted into for the copy back (bf16 AdamW: 4 + 4 + 8 + 2 = 18 B;
    bf16-pure and fp32: no conversion, no buffer)."""
    got, device_grads, sums = _offloaded_bytes(precision, "adamw", on_device=True)
    compute, cost = get_precision(precision).compute, PRECISIONS[precision]
    want = sum(host_param_bytes(s, compute, "adamw", cost, on_device=True) for s in SHAPES)
    assert (got, device_grads) == (want, 0)
    assert sums == sum(device_sum_bytes(s, compute, cost) for s in SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    if precision == "bf16":
        assert (want, sums) == (18 * numel, 4 * numel)
    if precision == "bf16-pure":
        assert want == 8 * numel  # bf16 master, sum and two moments: 2 + 2 + 4, no staging


def test_summed_on_the_device_the_link_carries_the_sum_once_a_step(tiny_bf16_plan):
    """The formula: 4 B an element down once a step (at the S, before the CPU step) in place
    of the weights' 2 B per micro-batch and their sums on the host; the same CPU step and
    upload; the GPU holds 4 B an element more than streaming."""
    plan = tiny_bf16_plan
    link = 5e9
    share = (link, 1e10, 2e10)
    for s in plan.stages:
        numel = sum(math.prod(p.shape) for p in plan.params if p.name in s.params and p.trainable)
        streamed = replace(s, offload=Offload(optimizer=True))
        summed = replace(s, offload=Offload(optimizer=True, gradients="device"))
        a, b = optimizer_times(plan, streamed, share), optimizer_times(plan, summed, share)
        assert (a.grad_bytes, b.grad_bytes, b.grad_s) == (2 * numel, 0, 0.0)
        assert b.sum_bytes == 4 * numel and b.sum_s == pytest.approx(4 * numel / link)
        assert (b.cpu_s, b.upload_s, b.up_bytes) == (a.cpu_s, a.upload_s, a.up_bytes)
        assert b.per_step_s(8) == pytest.approx(4 * numel / link + a.cpu_s + a.upload_s)
        assert a.per_step_s(8) == pytest.approx(8 * a.grad_s + a.cpu_s + a.upload_s)
        with_sums = plan.stage_memory(summed)[0] - plan.stage_memory(streamed)[0]
        assert with_sums == 4 * numel


def _policy(in_flight=5, recompute=False):
    return StagePolicy(recompute=recompute, in_flight=in_flight)


def test_the_gpu_keeps_the_weights_and_two_micro_batches():
    """Optimizer offloaded: the weights alone (no gradient, master or state); activations
    offloaded: two micro-batches' of what the stage keeps (inputs when it recomputes), the
    one in flight and the one prefetched."""
    weight, rest = param_bytes((1024, 1024), "bfloat16", True, "adamw", PRECISIONS["bf16"])
    args = dict(trainable_bytes=weight, frozen_bytes=0, state_bytes=rest, input_bytes=10,
                act_bytes=1000)  # fmt: skip
    held, _ = stage_memory(**args, policy=_policy())
    assert held == weight + rest + 5 * 1000
    held, _ = stage_memory(**args, policy=_policy(), offload=Offload(optimizer=True))
    assert held == weight + 5 * 1000
    held, _ = stage_memory(**args, policy=_policy(), offload=Offload(activations=True))
    assert held == weight + rest + 2 * 1000
    held, transient = stage_memory(
        **args, policy=_policy(recompute=True), offload=Offload(optimizer=True, activations=True)
    )
    assert (held, transient) == (weight + 2 * 10, 1000)  # the recompute's activations: one
    held, _ = stage_memory(**args, policy=_policy(in_flight=1), offload=Offload(activations=True))
    assert held == weight + rest + 1000  # one in flight: nothing to offload


def test_defaults_and_sharing():
    """A hardware file without a host section: twice the node's GPU memory, PCIe 3.0 x16,
    pairs of GPUs per switch; a GPU's share of the node is the node's over the GPUs that
    offload, its own link at most."""
    host = Host.of(None, gpu_memory=2**34, gpus_per_node=8)
    assert host.memory_bytes == 2 * 8 * 2**34
    assert host.node_bandwidth == 4 * host.link_bandwidth == 4 * 12e9
    assert host.step_bandwidth == host.sum_bandwidth
    assert host.share(1)[0] == host.share(4)[0] == 12e9
    assert host.share(8) == (6e9, host.step_bandwidth / 8, host.sum_bandwidth / 8)
    with pytest.raises(ValueError, match="host step_bandwidth must be a positive number"):
        Host.of({"step_bandwidth": 0}, gpu_memory=1, gpus_per_node=1)


@pytest.mark.parametrize("name", config_names("hardware"))
def test_every_hardware_file_describes_its_host_with_a_source(name):
    section = load_config("hardware", name).get("host")
    assert section, f"{name} has no host section"
    for key in ("memory_bytes", "link_bandwidth", "node_bandwidth", "step_bandwidth"):
        assert section[key] > 0, key
    sources = load_config("hardware", name)["sources"]
    assert any(s.startswith("host (") for s in sources), sources
    host = get_hardware(name).host
    assert host.node_bandwidth >= host.link_bandwidth
    assert host.device_is_host == (name == "cpu")


def test_a_bad_host_figure_is_one_sentence():
    from ftpipe_compiler.costs.hardware import Hardware

    d = dict(load_config("hardware", "rtx4090"))
    with pytest.raises(FtpipeError, match="hardware 'rtx4090': host memory_bytes must be a"):
        Hardware.from_json({**d, "host": {"memory_bytes": "lots"}})


@pytest.fixture(scope="module")
def tiny_bf16_plan():
    """GPT-2 tiny in bf16 with fp32 masters, 2 stages (analytic costs)."""
    from ftpipe_compiler.costs.profilers import costed_graph
    from ftpipe_compiler.partition import problem_from_graph, run_partitioner

    *_, graph = costed_graph("gpt2-tiny", precision="bf16")
    problem = problem_from_graph(graph, 2, "rtx4090", "1f1b", "adamw", 8)
    plan = run_partitioner(problem, "even-layers").plan
    assert plan.model.get("precision") == "bf16"
    return plan


@pytest.mark.parametrize(
    "schedule,step",
    [("gpipe", "exact"), ("1f1b", "exact"), ("ftpipe", "exact"), ("ftpipe", "lagged"),
     ("2bw", "exact")],
)  # fmt: skip
def test_a_sum_apart_is_counted_where_the_runtime_can_make_one(tmp_path, monkeypatch, schedule,
                                                                step):  # fmt: skip
    """`sums_apart` against the runtime: the stages whose gradients came while their CPU
    step had not landed (`HostOffload._add`'s sum apart; whether the step still held its
    own sum then is the machine's timing) on the toy's four stages on one rank. FTPipe's
    land at their next forward or recomputing backward: none; lagged, at their next step:
    each; 2BW's backwards on the older version come before the new one is read."""
    from ftpipe_runtime import run
    from runtime_toy import STAGES, one_rank_plan

    from ftpipe_compiler.plan import Plan

    apart, add = set(), HostOffload._add

    def spy(self, stage, master, g):
        if stage in self._inflight:
            apart.add(stage)
        add(self, stage, master, g)

    monkeypatch.setattr(HostOffload, "_add", spy)
    toy = one_rank_plan(schedule)
    argv = ["--steps", "3", "--offload-optimizer", "--offload-step", step]
    run(toy, STAGES, [*argv, "--checkpoint-dir", str(tmp_path)])
    plan = Plan.from_dict(toy)
    plan = plan.with_(stages=tuple(
        replace(s, offload=Offload(optimizer=True, step=step)) for s in plan.stages
    ))  # fmt: skip
    assert apart == set(plan.sums_apart)
    assert bool(apart) == (schedule == "2bw" or step == "lagged")
