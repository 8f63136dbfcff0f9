"""Data parallelism in the simulator: each stage's gradient all-reduce, charged as the
runtime runs it (buckets started during the step's last backward, the step waiting for the
last), over the link its replicas span; pipeline transfers across nodes on the node's
network interface."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ftpipe_runtime.train.replicas import BUCKET_BYTES
from sim_plans import make_plan

from ftpipe_compiler.costs.cluster import Cluster, Link
from ftpipe_compiler.costs.formulas import ring_allreduce_s
from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.planner import placement
from ftpipe_compiler.simulate import simulate

MB = 1_000_000
INTRA, INTER = Link("intra", 2e9, 1e-4), Link("inter", 0.5e9, 3e-4)


def cluster(gpus: int, per_node: int) -> Cluster:
    return Cluster(get_hardware("cpu"), gpus, per_node, INTRA, INTER)


def replicated(plan, replicas: int, per_node: int, orientation="pipeline", grads=(10 * MB,)):
    """`plan` with `replicas` copies and its stage 0's gradients of the given sizes."""
    first = next(p for p in plan.params if p.stages == (0,))
    params = tuple(replace(first, name=f"g{i}", bytes=n) for i, n in enumerate(grads)) + tuple(
        p for p in plan.params if p.stages != (0,)
    )
    stages = tuple(
        replace(s, params=tuple(f"g{i}" for i in range(len(grads)))) if s.id == 0 else s
        for s in plan.stages
    )
    return plan.with_(
        params=params,
        stages=stages,
        replicas=replicas,
        placement=placement(replicas, plan.gpus, orientation),
        cluster=cluster(replicas * plan.gpus, per_node),
    )


def test_one_bucket_is_summed_after_the_last_backward():
    """One stage, GPipe: the step is m forwards, m backwards (the loss stage keeps its
    activations: no recompute), then the ring."""
    f, b, r, m = 0.1, 0.2, 0.1, 4
    plan = make_plan([(f, b, r)], schedule="gpipe", micro_batches=m)
    for per_node, link in ((2, INTRA), (1, INTER)):  # replicas in one node, or two nodes
        sim = simulate(replicated(plan, 2, per_node), steps=6)
        ring = ring_allreduce_s(10 * MB, 2, link.bandwidth, link.latency_s)
        assert sim.step_time_s == pytest.approx(m * (f + b) + ring, rel=1e-9)
        assert sim.samples_per_s == pytest.approx(2 * m * 2 / sim.step_time_s)  # 2 replicas
        assert sim.replicas == 2


@pytest.mark.parametrize("b", [0.01, 0.4])
def test_buckets_overlap_the_last_backward(b):
    """Four buckets appear a quarter of the last backward apart; each
    starts when ready and after the one before: a slow network queues them all behind the
    first, a fast one leaves only the last exposed."""
    f, r, m = 0.1, 0.1, 2
    size = BUCKET_BYTES // 2 + 1  # one parameter per bucket
    plan = replicated(make_plan([(f, b, r)], schedule="gpipe", micro_batches=m), 2, 2,
                      grads=(size,) * 4)  # fmt: skip
    ring = ring_allreduce_s(size, 2, INTRA.bandwidth, INTRA.latency_s)
    # The last backward starts its gradients (the one stage computes the loss: it keeps its
    # activations under GPipe, no recompute).
    grads_from = m * f + (m - 1) * b
    if ring > b / 4:
        end = grads_from + b / 4 + 4 * ring
    else:
        end = grads_from + b + ring
    assert simulate(plan, steps=6).step_time_s == pytest.approx(end, rel=1e-9)


def test_one_replica_is_the_single_pipeline():
    plan = make_plan([(0.1, 0.2, 0.1)] * 3, nbytes=4 * MB, bandwidth=INTRA.bandwidth)
    plan = plan.with_(latency_s=INTRA.latency_s)  # the same link as the cluster's
    alone = simulate(plan, steps=8)
    one = replicated(plan, 1, 8)
    assert simulate(one, steps=8).step_time_s == pytest.approx(alone.step_time_s, rel=1e-12)


def test_transfers_across_nodes_take_the_network():
    """Two GPUs on two nodes: the activation goes at the network's bandwidth (plus its
    latency), as if the plan's one link were that slow."""
    costs = [(0.01, 0.02, 0.01)] * 2
    plan = make_plan(costs, nbytes=20 * MB, bandwidth=INTRA.bandwidth)
    apart = plan.with_(cluster=cluster(2, 1))
    slow = make_plan(costs, nbytes=20 * MB, bandwidth=INTER.bandwidth)
    got, want = simulate(apart, steps=8), simulate(slow, steps=8)
    assert got.step_time_s > simulate(plan, steps=8).step_time_s
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=0.05)


def test_replicas_on_one_node_share_its_network_interface():
    """Two replicas of a 2-GPU pipeline in the replica orientation, 2 GPUs per node: both
    replicas' GPU 0 on node 0 and GPU 1 on node 1, so both replicas' activations leave
    node 0 at once through its interface, slower than one pipeline alone on two nodes."""
    costs = [(0.01, 0.02, 0.01)] * 2
    plan = make_plan(costs, nbytes=20 * MB, bandwidth=INTRA.bandwidth)
    alone = simulate(plan.with_(cluster=cluster(2, 1)), steps=8)
    shared = replicated(plan, 2, 2, "replica", grads=(4,))  # stage GPUs on separate nodes
    assert simulate(shared, steps=8).step_time_s > alone.step_time_s
