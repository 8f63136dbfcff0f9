"""A GPU's memory beside its stages (issue 31): the device's reserve, the runtime's receive
buffers and held messages, a tied weight's copy and gradient, the replicas' flat gradients,
a backward's largest gradient, each against a hand computation on a two-GPU plan."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from click.testing import CliRunner
from ftpipe_runtime.engine.comm import POST_AHEAD_BYTES, POST_AHEAD_MESSAGES

from ftpipe_compiler.cli import cli
from ftpipe_compiler.costs.formulas import MemoryReserve, posted_bytes
from ftpipe_compiler.costs.gpu_memory import gpu_memory
from ftpipe_compiler.costs.host import Host
from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.plan import Plan, PlanParam, Stage, Transfer
from ftpipe_compiler.simulate import simulate

E, H = 4000, 400  # the tied weight's bytes (fp32), the activation's per micro-batch
RESERVE = MemoryReserve(context_bytes=10_000, communicator_bytes=1_000, fragmentation=0.1)


def tied_plan(**changes) -> Plan:
    """GPipe, 4 micro-batches. Stage 0 (GPU 0) owns `emb` (E bytes, AdamW: 4 E in all) and
    `w0`, sends `h` and `emb` to stage 1 (GPU 1), the loss stage, which owns `w1`."""

    def stage(i, params, inputs, outputs, input_bytes, act_bytes):
        return Stage(i, i, (f"n{i}",), 1.0, 2.0, 1.0, i == 0, 1 - i, params, inputs, outputs,
                     ("x",) if i == 0 else ("labels",), input_bytes, act_bytes)  # fmt: skip

    def param(name, nbytes, owner):
        return PlanParam(name, (nbytes // 4,), "float32", nbytes, 4 * nbytes, True, (), (owner,))

    plan = Plan(
        partitioner="test",
        gpus=2,
        schedule="gpipe",
        micro_batches=4,
        optimizer="adamw",
        bandwidth=1e9,
        memory_bytes=10**9,
        stages=(
            stage(0, ("emb", "w0"), (), ("h", "emb"), 64, 1000),
            stage(1, ("w1",), ("h", "emb"), (), H + E, 2000),
        ),
        transfers=(
            Transfer("h", 0, (1,), (H // 4,), "float32", H, True),
            Transfer("emb", 0, (1,), (E // 4,), "float32", E, True),
        ),
        params=(param("emb", E, 0), param("w0", 400, 0), param("w1", 800, 1)),
        loss_stage=1,
        reserve=replace(RESERVE, sends_held=True),
    )
    return replace(plan, **changes)


def test_every_part_of_both_gpus_by_hand():
    plan = tied_plan()
    ahead = 1000  # --post-ahead: bytes of receive buffers per source, one message past it
    owner, reader = (gpu_memory(plan, g, post_ahead_bytes=ahead) for g in (0, 1))
    # Stage 0 recomputes: weights once, gradient and two AdamW moments, 4 micro-batches of
    # inputs, and one micro-batch's activations while it recomputes. Stage 1 (the loss stage)
    # keeps the activations of its 4 micro-batches, and reads `emb` as it came: one copy.
    assert owner.stages == (E + 400) + 3 * (E + 400) + 4 * 64 + 1000
    assert reader.stages == 800 + 3 * 800 + 4 * 2000
    assert (owner.received_weights, reader.received_weights) == (0, E)
    assert (owner.weight_grads, reader.weight_grads) == (0, E)  # summed over the step
    # gloo holds a step's sends until its step: h out (owner), its gradient back (reader).
    assert owner.sends == reader.sends == 4 * H
    # A step's messages, each way: h four times then emb; h's gradient four times then emb's.
    # The most posted after a receive: from the third h on, 400 + 400 (< 1000) and emb.
    assert posted_bytes([H] * 4 + [E], ahead, 64) == 2 * H + E
    assert owner.posted == reader.posted == 2 * H + E
    assert owner.replicas == reader.replicas == 0
    assert owner.transient == reader.transient == E  # autograd's gradient of emb, then added
    tensors = owner.stages + 4 * H + (2 * H + E) + E
    # Context, a communicator for each direction between the GPUs and the job's, 10%.
    assert owner.tensors == tensors
    assert owner.reserve == math.ceil(10_000 + 3 * 1_000 + 0.1 * tensors)
    assert owner.total == tensors + owner.reserve
    # The plan's figure: the same, with the runtime's default window (all 64 messages here).
    window = posted_bytes([H] * 4 + [E], POST_AHEAD_BYTES, POST_AHEAD_MESSAGES)
    assert plan.gpu_memory(0) == owner.total - owner.posted + window + math.ceil(
        0.1 * (window - owner.posted)
    )


def test_replicas_mixed_precision_and_asynchronous_schedules_add_their_buffers():
    plan = tied_plan(replicas=2, placement=((0, 0), (0, 1), (1, 0), (1, 1)))
    # Each GPU sums its gradients with its replica's through a flat copy of them all.
    assert gpu_memory(plan, 0).replicas == E + 400 and gpu_memory(plan, 1).replicas == 800
    # Mixed precision: the hook adds the largest 16-bit gradient into its fp32 sum with no
    # fp32 copy of it (`precision.add_into`), so the gradient alone is the transient.
    bf16 = tied_plan(model={"precision": "bf16"})
    bf16 = replace(bf16, params=tuple(replace(p, dtype="bfloat16") for p in bf16.params))
    assert gpu_memory(bf16, 0).transient == E
    # PipeDream-2BW: the owner sends each version of emb as a copy, and gloo holds two
    # steps of sends (the reader's the previous step's weight gradient too).
    two = tied_plan(schedule="2bw")
    assert gpu_memory(two, 0).sends == 2 * (4 * H + E)
    assert gpu_memory(two, 1).sends == 2 * 4 * H + E
    # NCCL lets each send go as it completes: only 2BW's copies of emb remain.
    nccl = replace(two, reserve=RESERVE)
    assert (gpu_memory(nccl, 0).sends, gpu_memory(nccl, 1).sends) == (E, 0)


def test_a_stage_reading_a_weight_twice_holds_both_its_gradients():
    """T5's decoder embeds and predicts with the tied weight: its backward holds the head's
    gradient of it and the embedding's before adding them (measured: 1.29 x the plan on a
    2-rank T5 counting one, tests/runtime/job/test_memory_plan.py)."""
    plan = tied_plan()
    once = gpu_memory(plan, 1).transient
    twice = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], reread=("emb",))))
    assert (once, gpu_memory(twice, 1).transient) == (E, 2 * E)
    assert gpu_memory(twice, 0).transient == E  # the owner reads it once
    # On the owner's stage: its own parameter, read twice there.
    own = replace(plan, stages=(replace(plan.stages[0], reread=("emb",)), plan.stages[1]))
    assert gpu_memory(own, 0).transient == 2 * E


def test_on_a_cpu_rank_the_next_weights_land_where_the_old_go():
    """A posted receive on a CPU holds memory once its message lands. Under GPipe the next
    step's `emb` lands after the reader's last backward, where the version it replaces is
    let go: counted once (`received_weights`), not again as posted. Its gradient to the
    owner, and an asynchronous schedule's next version (it may land before the reader's
    peak), still count; and on a GPU, where the allocator holds a buffer from its post, all
    of them."""
    cpu = Host(device_is_host=True)
    ahead = 1000
    plan = tied_plan(host=cpu)
    # The most waiting: three h (the window, 1000 bytes, full); before, two h and emb.
    assert gpu_memory(plan, 1, post_ahead_bytes=ahead).posted == 3 * H
    assert gpu_memory(plan, 0, post_ahead_bytes=ahead).posted == 2 * H + E  # emb's gradient
    ftpipe = tied_plan(host=cpu, schedule="ftpipe")
    assert gpu_memory(ftpipe, 1, post_ahead_bytes=ahead).posted == 2 * H + E
    two = tied_plan(host=cpu, schedule="2bw")
    assert gpu_memory(two, 1, post_ahead_bytes=ahead).posted == 2 * H + E
    assert gpu_memory(tied_plan(), 1, post_ahead_bytes=ahead).posted == 2 * H + E
    # What is posted is still the runtime's window: the same messages, by their sizes.
    assert posted_bytes([H, E], 500, 64, held=[H, 0]) == H
    assert posted_bytes([H, E], 500, 64) == H + E


def test_a_plan_that_fit_before_has_less_headroom_and_may_not_fit():
    bare = tied_plan(reserve=MemoryReserve())  # the stages alone, as plans were counted
    reserved = tied_plan()
    for g in range(2):
        assert reserved.gpu_memory(g) > bare.gpu_memory(g) > bare.gpu_memory_parts(g).stages
    stages_only = max(bare.gpu_memory_parts(g).stages for g in range(2))
    tight = replace(reserved, memory_bytes=stages_only + 100)  # fit when stages were all
    assert not tight.feasible
    with pytest.raises(FtpipeError, match="GPU 0 needs"):
        tight.validate()
    sim = simulate(tight, steps=4)
    assert not sim.fits and min(g.headroom_bytes for g in sim.gpus) < 0
    roomy = replace(reserved, memory_bytes=10**6)
    sim = simulate(roomy, steps=4)
    assert sim.fits
    assert [g.headroom_bytes for g in sim.gpus] == [
        10**6 - roomy.gpu_memory(g.gpu, dict(enumerate(sim.in_flight))) for g in sim.gpus
    ]


def test_simulate_shows_peak_and_headroom_per_gpu(tmp_path):
    plan = replace(tied_plan(), memory_bytes=60_000)
    plan.save(tmp_path / "plan.json")
    res = CliRunner().invoke(cli, ["simulate", str(tmp_path / "plan.json"), "--steps", "4"])
    assert res.exit_code == 0, res.output
    assert "memory GiB / capacity   headroom" in res.output
    sim = simulate(plan, steps=4)
    for g in sim.gpus:
        row = next(r for r in res.output.splitlines() if r.startswith(f"  {g.gpu:>3} "))
        assert f"{g.headroom_bytes / 2**30:8.2f}" in row
