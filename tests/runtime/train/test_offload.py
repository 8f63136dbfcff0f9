"""--offload-optimizer (`ftpipe_runtime.train.offload`): the masters and the optimizer state on
the host, gradients copied there as they are made, the step on the CPU, the weights copied
back. The reference is the same run without it: on CPU ranks the same additions and the same
optimizer kernel, so the weights are expected bit for bit, in fp32 and in bf16."""

from __future__ import annotations

import json
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.job.prepare import _offload
from ftpipe_runtime.train.offload import HostOffload
from ftpipe_runtime.train.optim import make_optimizer
from ftpipe_runtime.train.precision import MixedPrecision, get_precision
from runtime_helpers import crash_and_resume
from runtime_reference import checkpoint_params
from runtime_toy import one_rank_plan, toy_plan

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _trained(dtype: str, offload: bool, on_device: bool = False):
    """A two-layer module in `dtype`, three backwards summed (two through autograd's hook,
    one through `add_grad` as a split backward's weight pass), clipped, stepped twice;
    `on_device`: the offloaded gradients summed on the device, copied once a step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    net = net.to(getattr(torch, get_precision(dtype).compute))
    host = HostOffload("cpu", on_device={0} if on_device else ()) if offload else None
    mixed = MixedPrecision(get_precision(dtype), {0: net}, offload=host)
    opt = make_optimizer("adamw", [t for _, t in mixed.trainable(0)], 0.05)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(net[0].weight.dtype)
    for _ in range(2):
        net(x).square().sum().backward()
        net(x.flip(0)).pow(3).sum().backward()
        out = net(x * 2).sum()
        weights = list(net.parameters())
        for w, g in zip(weights, torch.autograd.grad(out, weights), strict=True):
            mixed.add_grad(w, g)
        if on_device:  # nothing on the host before the stage's step
            assert all(master.grad is None for _, master in mixed.trainable(0))
        mixed.settle(0)
        for _, master in mixed.trainable(0):
            master.grad.mul_(0.5)  # as clipping scales the gradients where they are
        opt.step()
        mixed.after_step(0)
        for _, master in mixed.trainable(0):
            master.grad = None
    return net, mixed, opt


@pytest.mark.parametrize("on_device", [False, True], ids=["host-sum", "device-sum"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_masters_and_state_are_host_copies_with_the_same_update(dtype, on_device):
    net, mixed, opt = _trained(dtype, offload=True, on_device=on_device)
    ref, ref_mixed, _ = _trained(dtype, offload=False)
    weights = dict(net.named_parameters())
    held = {p.data_ptr() for p in net.parameters()}
    for name, master in mixed.trainable(0):
        assert master.device.type == "cpu" and master.dtype == torch.float32
        assert master is not weights[name] and master.data_ptr() not in held  # no alias
        state = opt.state[master]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device.type == "cpu" and state[key].data_ptr() not in held
        # the stage's weights are the masters, in the compute dtype
        assert torch.equal(weights[name], master.detach().to(weights[name].dtype))
    for (name, master), (_, want) in zip(mixed.trainable(0), ref_mixed.trainable(0), strict=True):
        assert torch.equal(master, want), name  # the same update, bit for bit
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def _overlapped(overlap: bool):
    """Two offloaded bf16 steps whose gradients are taken at a set-aside copy of the first
    weights (as PipeDream-2BW's actions on the older version are); with `overlap` the first
    step runs on the host's thread, held there until the next step's gradients are in."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    net = net.to(torch.bfloat16)
    host = HostOffload("cpu")
    mixed = MixedPrecision(get_precision("bf16"), {0: net}, offload=host)
    opt = make_optimizer("adamw", [t for _, t in mixed.trainable(0)], 0.05)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    older = {n: p.detach().clone().requires_grad_(True) for n, p in net.named_parameters()}

    def gradients(scale: float) -> None:
        out = torch.func.functional_call(net, older, (x * scale,)).float().square().sum()
        for w, g in zip(net.parameters(), torch.autograd.grad(out, list(older.values()))):
            mixed.add_grad(w, g)

    gradients(1.0)
    gradients(2.0)
    mixed.settle(0)
    first = [master.grad.clone() for _, master in mixed.trainable(0)]
    gate, in_flight = threading.Event(), []
    if overlap:
        mixed.launch(0, lambda: (gate.wait(10), opt.step()))
        in_flight.append(host.pending(0))
    else:
        opt.step()
        mixed.after_step(0)
        for _, master in mixed.trainable(0):
            master.grad = None
    gradients(3.0)  # the next step's, while the first may still be stepping
    gradients(4.0)
    if overlap:
        untouched = [master.grad for _, master in mixed.trainable(0)]
        assert all(torch.equal(a, b) for a, b in zip(untouched, first, strict=True))
        gate.set()
        mixed.land(0)
        in_flight.append(host.pending(0))
    mixed.settle(0)
    opt.step()
    mixed.after_step(0)
    return net, mixed, in_flight, host.clock.seconds


def test_an_overlapped_step_runs_beside_the_next_gradients_and_lands_the_same():
    """`launch`: the CPU step on the host's thread while the rank goes on, the next step's
    gradients summed apart; `land`: the new weights and those sums in place. Bit for bit
    the masters and weights of the step run in line."""
    net, mixed, in_flight, seconds = _overlapped(True)
    ref, ref_mixed, _, _ = _overlapped(False)
    assert in_flight == [True, False]  # it ran until the rank's next gradients were in
    assert seconds["step_wait"] > 0 and seconds["cpu_step"] > 0
    for (name, master), (_, want) in zip(mixed.trainable(0), ref_mixed.trainable(0), strict=True):
        assert torch.equal(master, want), name
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_an_error_on_the_step_thread_is_raised_where_the_step_lands():
    net = torch.nn.Linear(3, 2)
    host = HostOffload("cpu")
    mixed = MixedPrecision(get_precision("fp32"), {0: net}, offload=host)

    def broken():
        raise RuntimeError("the CPU step failed")

    mixed.launch(0, broken)
    with pytest.raises(RuntimeError, match="CPU step failed"):
        mixed.land(0)
    assert not host.pending(0)


def test_device_sums_are_made_once_and_land_once_a_step():
    """Summed on the device: one accumulator per weight in the master's dtype, and one
    host copy of it, both reused by the next step; the only 16-bit host buffers are those
    the new weights are converted into for the copy back (no landing buffers)."""
    _, mixed, _ = _trained("bf16", offload=True, on_device=True)
    host = mixed.offload
    masters = {id(t) for _, t in mixed.trainable(0)}
    assert set(host._sums) == set(host._landed) == set(host._buffers) == masters
    assert all(t.dtype == torch.float32 for t in host._sums.values())
    for _, master in mixed.trainable(0):  # staged: the weight's dtype, the master's values
        staged = host._buffers[id(master)]
        assert staged.dtype == torch.bfloat16 and torch.equal(staged, master.detach().bfloat16())
    held = {k: (t.data_ptr(), host._landed[k].data_ptr()) for k, t in host._sums.items()}
    weights = [w for _, w in mixed.weights(0)]
    x = torch.ones(2, weights[0].shape[1], dtype=torch.bfloat16)
    y = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, *weights[:2])),
                                   *weights[2:])  # fmt: skip
    y.sum().backward()  # another step's micro-batch
    mixed.settle(0)
    assert held == {k: (t.data_ptr(), host._landed[k].data_ptr()) for k, t in host._sums.items()}
    for _, master in mixed.trainable(0):
        assert master.grad is host._landed[id(master)]
    assert all(w.grad is None for w in weights)  # the device keeps only its sums


# --- 2 CPU ranks: the run with --offload-optimizer is the run without ---

STEPS = 3
ARGV = ["--steps", str(STEPS), "--data", "copy", "--optimizer", "adamw", "--lr", "0.05"]
ARGV += ["--weight-decay", "0.01", "--clip", "0.5", "--save-every", str(STEPS)]


def _pair(run_pipeline, tmp_path, schedule: str, dtype: str, plan=None):
    """(losses, final weights) without and with --offload-optimizer."""
    plan = plan or toy_plan("two-ranks", schedule, 4, DTYPES[dtype])
    out = []
    for name, extra in (("plain", []), ("offload", ["--offload-optimizer"])):
        ckpt, log = tmp_path / name, tmp_path / f"{name}.json"
        argv = [*ARGV, "--schedule", schedule, "--dtype", dtype, *extra]
        argv += ["--checkpoint-dir", str(ckpt), "--log-json", str(log)]
        codes, ranks = run_pipeline(plan, argv, name=name)
        assert codes == [0] * len(codes), ranks.stderr()
        summary = json.loads(log.read_text())
        assert summary.get("replica_difference", 0.0) == 0.0
        if extra:  # where each rank's offloaded steps spent their time (train.offload.PHASES)
            for seconds in summary["offload_seconds"]:
                assert seconds["cpu_step"] > 0 and seconds["host_sums"] > 0, seconds
            assert "optimizer offload, per step on rank" in ranks.stderr(0)
        else:
            assert "offload_seconds" not in summary
        out.append(
            (json.loads(log.read_text())["losses"], checkpoint_params(ckpt, STEPS, range(4)))
        )
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("schedule", "dtype"),
    [
        pytest.param("gpipe", "fp32", marks=pytest.mark.exhaustive),  # make test-all
        pytest.param("1f1b", "fp32", marks=pytest.mark.exhaustive),
        ("ftpipe", "fp32"),
        ("1f1b", "bf16"),
        ("2bw", "fp32"),  # the CPU step overlaps the stage's actions on the older version
        ("2bw", "bf16"),
    ],
)
def test_offloaded_run_equals_the_run_without(run_pipeline, tmp_path, schedule, dtype):
    """Two stages a rank, a weight read on the other rank (its gradient sent back), clipping
    over both ranks (synchronous) or per stage (ftpipe, which steps each stage on its own and
    runs later micro-batches on the weight versions it set aside)."""
    (losses, weights), (off_losses, off_weights) = _pair(run_pipeline, tmp_path, schedule, dtype)
    assert off_losses == losses
    assert off_weights.keys() == weights.keys()
    for name, value in weights.items():
        assert value.dtype == torch.float32  # the masters, as checkpoints keep them
        # Bit for bit, in bf16 too (the issue asks 1e-6, and bf16's tolerance): on the CPU
        # both sum the same gradients in the same order and step with the same kernel.
        assert torch.equal(off_weights[name], value), name


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", ["1f1b", "ftpipe"])
def test_offloaded_run_on_four_ranks_equals_the_run_without(run_pipeline, tmp_path, schedule):
    """One stage a rank on 4 ranks: each rank's CPU step beside its next actions, the same
    weights and losses bit for bit."""
    plan = toy_plan("four-ranks", schedule, 4, "float32")
    (losses, weights), (off_losses, off_weights) = _pair(
        run_pipeline, tmp_path, schedule, "fp32", plan
    )
    assert off_losses == losses
    for name, value in weights.items():
        assert torch.equal(off_weights[name], value), name


@pytest.mark.multiproc
def test_a_weight_read_on_its_own_rank_sees_the_version_its_reader_needs(run_pipeline, tmp_path):
    """Folded under ftpipe: stage 3 reads stage 0's weight on the same rank, and stage 0's
    overlapped step lands after stage 0's S, at its next forward: stage 3 still reads the
    value its micro-batch's forward of stage 0 read, as without offload."""
    plan = toy_plan("folded", "ftpipe", 4, "float32")
    (losses, weights), (off_losses, off_weights) = _pair(
        run_pipeline, tmp_path, "ftpipe", "fp32", plan
    )
    assert off_losses == losses
    for name, value in weights.items():
        assert torch.equal(off_weights[name], value), name


@pytest.mark.multiproc
def test_offloaded_replicas_equal_the_run_without(run_pipeline, tmp_path):
    """2 data-parallel replicas (all stages on one rank each) in bf16: the gradients summed
    with the replica's on the host masters, the same as summed beside the weights."""
    plan = one_rank_plan("gpipe", 2, "bfloat16")
    plan = {**plan, "replicas": 2, "placement": [[0, 0], [1, 0]]}
    (losses, weights), (off_losses, off_weights) = _pair(
        run_pipeline, tmp_path, "gpipe", "bf16", plan
    )
    assert off_losses == losses
    for name, value in weights.items():
        assert torch.equal(off_weights[name], value), name


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("schedule", "step"), [("ftpipe", "exact"), ("2bw", "exact"), ("ftpipe", "lagged")]
)
def test_resume_from_an_offloaded_checkpoint_is_exact(run_pipeline, tmp_path, schedule, step):
    """Stopped after a checkpoint and resumed, an offloaded run ends with the weights and the
    losses of the uninterrupted one (masters and host optimizer state saved per stage,
    loaded back onto the host; a step still stepping done first; lagged, the older weights
    its actions read until its next step kept beside them)."""
    plan = toy_plan("two-ranks", schedule)
    argv = ["--steps", "6", "--save-every", "2", "--data", "copy", "--optimizer", "adamw"]
    argv += ["--lr", "0.05", "--offload-optimizer", "--offload-step", step]
    whole, resumed = crash_and_resume(
        run_pipeline, tmp_path, plan, argv, range(4), fault="1:3:exit"
    )
    first = resumed["first_step"]
    assert first in (2, 4)
    assert resumed["losses"] == whole["losses"][first:]


@pytest.mark.multiproc
def test_a_lagged_checkpoint_resumes_with_either_step(run_pipeline, tmp_path):
    """A checkpoint of lagged steps keeps the older weights its stages' next actions read
    beside the masters. Resumed lagged, the first step reads those; resumed with
    --offload-step exact, the masters (the kept weights left out): the first losses differ."""
    plan = toy_plan("two-ranks", "ftpipe")
    argv = ["--steps", "4", "--save-every", "2", "--data", "copy", "--optimizer", "adamw",
            "--lr", "0.05", "--offload-optimizer"]  # fmt: skip
    first = tmp_path / "lagged"
    codes, ranks = run_pipeline(
        plan, [*argv, "--offload-step", "lagged", "--checkpoint-dir", str(first)], name="first"
    )
    assert codes == [0, 0], ranks.stderr()
    losses = {}
    for step in ("lagged", "exact"):
        folder, log = tmp_path / f"resumed-{step}", tmp_path / f"{step}.json"
        shutil.copytree(first, folder)
        more = ["--steps", "6", "--offload-step", step, "--resume", "--checkpoint-dir", str(folder),
                "--log-json", str(log)]  # fmt: skip
        codes, ranks = run_pipeline(plan, [*argv, *more], name=step)
        assert codes == [0, 0], ranks.stderr()
        summary = json.loads(log.read_text())
        assert summary["first_step"] == 4
        losses[step] = summary["losses"]
    assert losses["lagged"][0] != losses["exact"][0]


def _args(**given) -> SimpleNamespace:
    return SimpleNamespace(**{"offload_optimizer": True, "freeze_alpha": None, "freeze_at": [],
                              "freeze_every": 100, "no_shrink": False, **given})  # fmt: skip


def test_replicas_on_cuda_are_refused_in_one_sentence():
    """NCCL cannot sum gradients that live on the host: said before anything runs."""
    args = _args()
    place = SimpleNamespace(reps=SimpleNamespace(count=2), device=torch.device("cuda", 0))
    with pytest.raises(PipelineConfigError, match="--offload-optimizer does not run with"):
        _offload(args, place)
    assert _offload(_args(offload_optimizer=False), place) is None
    one = SimpleNamespace(reps=SimpleNamespace(count=1), device=torch.device("cpu"))
    assert isinstance(_offload(args, one), HostOffload)


def test_a_shrinking_freeze_on_cuda_is_refused_in_one_sentence():
    """The switch to a shorter plan hands the state over through the device: not yet with
    the state on the host; --no-shrink freezes on the same plan, which works."""
    cuda = SimpleNamespace(reps=SimpleNamespace(count=1), device=torch.device("cuda", 0))
    with pytest.raises(PipelineConfigError, match="add --no-shrink"):
        _offload(_args(freeze_at=[(10, 2)]), cuda)
    with pytest.raises(PipelineConfigError, match="add --no-shrink"):
        _offload(_args(freeze_alpha=0.5), cuda)
    assert isinstance(_offload(_args(freeze_at=[(10, 2)], no_shrink=True), cuda), HostOffload)


@pytest.mark.multiproc
@pytest.mark.exhaustive  # make test-all: the format is the same either way (the resume above)
def test_a_checkpoint_without_offload_resumes_with_it(run_pipeline, tmp_path):
    """The checkpoint format is the same: a run saved without the flag, resumed with it, ends
    where the run straight through without it ends (1f1b, bf16 masters)."""
    plan = toy_plan("two-ranks", "1f1b", 4, "bfloat16")
    argv = ["--steps", "4", "--save-every", "2", "--data", "copy", "--dtype", "bf16"]
    argv += ["--lr", "0.05", "--schedule", "1f1b"]
    logs = {}
    for name, folder, extra, env in [
        ("whole", "whole", [], {}),
        ("crash", "broken", [], {"FTPIPE_FAULT": "1:2:exit"}),  # after the 3rd step
        ("resume", "broken", ["--resume", "--offload-optimizer"], {}),
    ]:
        log = tmp_path / f"{name}.json"
        own = [*argv, *extra, "--checkpoint-dir", str(tmp_path / folder), "--log-json", str(log)]
        codes, ranks = run_pipeline(plan, own, name=name, env=env)
        assert (codes == [0, 0]) == (name != "crash"), ranks.stderr()
        if name != "crash":
            logs[name] = json.loads(log.read_text())
    assert logs["resume"]["first_step"] == 2
    assert logs["resume"]["losses"] == logs["whole"]["losses"][2:]
    whole = checkpoint_params(tmp_path / "whole", 4, range(4))
    resumed = checkpoint_params(tmp_path / "broken", 4, range(4))
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
