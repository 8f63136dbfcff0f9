"""The links a simulated pipeline replica uses, and its data-parallel gradient all-reduce.

    net = Network(plan)
    arrive = net.send(src_gpu, dst_gpu, nbytes, t)             # a pipeline transfer
    done = net.all_reduce(stage, gpu, grads_from, grads_to)     # a stage's gradient buckets

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
  stage's optimizer step waits for its last bucket.
"""

from __future__ import annotations

from ftpipe_runtime.train.replicas import BUCKET_BYTES, bucket_indices

from ..costs.cluster import Link
from ..plan import Plan


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
        self.buckets = {}
        for s in plan.stages:
            sizes = [by_name[n].bytes for n in s.params if by_name[n].trainable]
            self.buckets[s.id] = [sum(sizes[i] for i in b) for b in bucket_indices(sizes)]
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
        across = self.spans_nodes[gpu]
        link = self.inter if across else self.intra
        free, key = (self.nic_free, self.node[gpu]) if across else (self.dp_free, gpu)
        total, done, end = sum(sizes), 0, grads_to
        for nbytes in sizes:  # one after the other on the channel, each once it is ready
            done += nbytes
            ready = grads_from + (grads_to - grads_from) * done / total
            start = max(ready, free.get(key, 0.0))
            end = start + link.allreduce_s(nbytes, self.replicas)
            free[key] = end
        return max(end, grads_to)


__all__ = ["BUCKET_BYTES", "Network"]
