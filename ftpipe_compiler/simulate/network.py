"""The links a simulated pipeline replica uses, and its data-parallel gradient all-reduce.

    net = Network(plan)
    arrive = net.send(src_gpu, dst_gpu, nbytes, t)             # a pipeline transfer
    done = net.all_reduce(stage, gpu, grads_from, grads_to)     # a stage's gradient buckets
    done = net.all_gather(stage, gpu, t)       # a sharded stage's new weights, after its step

The simulator times replica 0; the others run the same lists at the same times, so what they
share with it is counted where they share it. Ranks sit on nodes in order (rank r on node
r // gpus_per_node), GPU g of replica 0 on the rank the plan's placement gives it.

- Two GPUs of one node: a link per ordered pair (the cluster's intra-node link, or the
  plan's point-to-point bandwidth and latency), one tensor at a time, each taking the
  link's latency plus its bytes over the bandwidth.
- Across nodes: the sending node's network interface, one transfer at a time (FIFO) at the
  cluster's inter-node bandwidth. Every replica with a GPU on that node sends the same
  tensor at the same moment, so a pipeline transfer occupies it that many times over.
- A stage's all-reduce, as the runtime does it (`ftpipe_runtime.train.replicas`): the stage's
  trainable gradients in buckets of `BUCKET_BYTES`, last parameters first; bucket j is ready
  when the stage's last backward of the step has produced it (gradients assumed to appear
  evenly over that backward, after its recompute) and is reduced as a ring, after bucket
  j - 1, over the slowest link its replicas span: the GPU's own intra-node channel when
  they share one node, else the node's interface (one ring crossing it per stage). The
  stage's optimizer step waits for its last bucket. The bytes are the gradients the
  optimizer steps: the fp32 masters' under mixed precision (`costs.gpu_memory.grad_bytes`),
  twice a 16-bit weight's.
- A stage that shards its optimizer state across the replicas (`Stage.shard_optimizer`,
  `ftpipe_runtime.train.zero`): each bucket reduce-scattered instead (one pass of the ring,
  not two), and after its step (1/replicas of the elements) the new weights all-gathered,
  bucket after bucket in the weights' dtype, before the step ends (`all_gather`): per
  replica (d-1)/d (4 + w) N bytes a step instead of 2 (d-1)/d 4N.
"""

from __future__ import annotations

from dataclasses import replace

from ftpipe_runtime.train.replicas import BUCKET_BYTES, bucket_indices

from ..costs.cluster import Link
from ..costs.formulas import PRECISIONS
from ..costs.gpu_memory import grad_bytes
from ..plan import Plan
from ..units import size


class Network:
    def __init__(self, plan: Plan):
        self.replicas = plan.replicas
        cluster = plan.cluster
        if cluster is None:  # a plan without a cluster: one node, its links the plan's
            self.intra = self.inter = Link("link", plan.bandwidth, plan.latency_s)
            per_node = plan.world
        else:
            self.intra, self.inter = cluster.intra_node, cluster.inter_node
            per_node = cluster.gpus_per_node
        rank_of = {rg: rank for rank, rg in enumerate(plan.placed())}
        self.node = {g: rank_of[(0, g)] // per_node for g in range(plan.gpus)}
        on_node: dict[int, set[int]] = {}
        for rank, (r, _) in enumerate(plan.placed()):
            on_node.setdefault(rank // per_node, set()).add(r)
        self.sharing = {n: len(rs) for n, rs in on_node.items()}  # replicas per node
        self.spans_nodes = {
            g: len({rank_of[(r, g)] // per_node for r in range(self.replicas)}) > 1
            for g in range(plan.gpus)
        }
        by_name = {p.name: p for p in plan.params}
        precision = PRECISIONS[plan.model.get("precision") or "fp32"]
        self.buckets, self.weight_buckets = {}, {}
        for s in plan.stages:
            owned = [by_name[n] for n in s.params if by_name[n].trainable]
            sizes = [grad_bytes(p, precision) for p in owned]
            buckets = bucket_indices(sizes)
            self.buckets[s.id] = [sum(sizes[i] for i in b) for b in buckets]
            self.weight_buckets[s.id] = [sum(owned[i].bytes for i in b) for b in buckets]
        self.sharded = {s.id for s in plan.stages if s.sharded_over(plan.replicas) > 1}
        self.pair_free: dict[tuple[int, int], float] = {}
        self.nic_free: dict[int, float] = {}
        self.dp_free: dict[int, float] = {}

    def send(self, src: int, dst: int, nbytes: int, t: float) -> float:
        """When `nbytes` sent from GPU `src` at time t arrive at GPU `dst`."""
        if src == dst:
            return t
        node = self.node[src]
        if node == self.node[dst]:  # each message costs the link its latency, then its bytes
            start = max(self.pair_free.get((src, dst), 0.0), t)
            arrive = start + self.intra.latency_s + nbytes / self.intra.bandwidth
            self.pair_free[src, dst] = arrive
            return arrive
        start = max(self.nic_free.get(node, 0.0), t)
        busy = self.sharing[node] * nbytes / self.inter.bandwidth
        self.nic_free[node] = start + busy
        return start + busy + self.inter.latency_s

    def all_reduce(self, stage: int, gpu: int, grads_from: float, grads_to: float) -> float:
        """When the all-reduce of `stage`'s gradients ends, its last backward producing them
        between `grads_from` and `grads_to`."""
        sizes = self.buckets[stage]
        if self.replicas == 1 or not sizes:
            return grads_to
        link, free, key = self._channel(gpu)
        passes = 1 if stage in self.sharded else 2  # a reduce-scatter, or an all-reduce
        total, done, end = sum(sizes), 0, grads_to
        for nbytes in sizes:  # one after the other on the channel, each once it is ready
            done += nbytes
            ready = grads_from + (grads_to - grads_from) * done / total
            start = max(ready, free.get(key, 0.0))
            end = start + link.allreduce_s(nbytes, self.replicas, passes=passes)
            free[key] = end
        return max(end, grads_to)

    def all_gather(self, stage: int, gpu: int, t: float) -> float:
        """When a sharded `stage`'s new weights, stepped by t, are all-gathered into every
        replica's (t itself where it does not shard)."""
        if stage not in self.sharded:
            return t
        link, free, key = self._channel(gpu)
        end = t
        for nbytes in self.weight_buckets[stage]:
            start = max(end, free.get(key, 0.0))
            end = start + link.allreduce_s(nbytes, self.replicas, passes=1)
            free[key] = end
        return end

    def _channel(self, gpu: int):
        """(link, free-times, key) of the ring GPU `gpu`'s replicas sum over."""
        if self.spans_nodes[gpu]:
            return self.inter, self.nic_free, self.node[gpu]
        return self.intra, self.dp_free, gpu


def shard_lines(plan: Plan) -> list[str]:
    """Which stages shard their optimizer state across the replicas, and why; and the bytes
    a replica sends per step to sum their gradients and share their weights, as rings move
    them (`ftpipe_runtime.train.zero`'s doc). [] when none does."""
    d = plan.replicas
    sharded = [s for s in plan.stages if s.sharded_over(d) > 1]
    if not sharded:
        return []
    mode = plan.model.get("shard_optimizer", "auto")
    whole = plan.with_(stages=tuple(replace(s, shard_optimizer=False) for s in plan.stages))
    lines = []
    for s in sharded:
        kept = size(whole.state_bytes(s) - plan.state_bytes(s))
        line = (
            f"stage {s.id} (GPU {s.gpu}) shards its masters and optimizer state across "
            f"{d} replicas ({kept} less on each)"
        )
        if mode == "auto":
            line += (
                f": GPU {s.gpu} would need {size(whole.gpu_memory(s.gpu))} of its "
                f"{size(plan.memory_bytes)} without, {size(plan.gpu_memory(s.gpu))} with it"
            )
        else:
            line += f": --shard-optimizer {mode}"
        lines.append(line)
    net = Network(plan)
    grads = sum(sum(net.buckets[s.id]) for s in sharded)
    weights = sum(sum(net.weight_buckets[s.id]) for s in sharded)
    ring = (d - 1) / d
    lines.append(
        f"their data-parallel traffic per replica and step: {size(ring * (grads + weights))} "
        f"(gradients reduce-scattered, weights all-gathered) instead of "
        f"{size(2 * ring * grads)} (all-reduced)"
    )
    return lines


__all__ = ["BUCKET_BYTES", "Network", "shard_lines"]
