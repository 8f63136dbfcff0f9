"""Small made-up graphs for the partitioner tests: chains and random DAGs with random costs."""

from __future__ import annotations

import random
from dataclasses import replace

from ftpipe_compiler.costs.formulas import MemoryReserve
from ftpipe_compiler.costs.hardware import Hardware
from ftpipe_compiler.graph.opgraph import Edge, ModelInput, Node, OpGraph, Param
from ftpipe_compiler.partition.problem import Problem

GIB = 2**30
MB = 2**20


def make_graph(
    n: int, seed: int, chain: bool = False, density: float = 0.25, loss: int = -1
) -> OpGraph:
    """n nodes in topological order; node i reads parameter w{i} on most nodes, and the
    first and last nodes share a tied parameter (like an embedding and an LM head).
    `loss`: index of the node whose output is the loss (default the last)."""
    rng = random.Random(seed)
    nodes, edges = [], []
    params = {"tied": Param("tied", (64, 64), "float32", 64 * 64 * 4, aliases=("head.weight",))}
    for i in range(n):
        if chain:
            preds = [i - 1] if i else []
        else:
            preds = (
                sorted(
                    {rng.randrange(i)}
                    | {j for j in range(i) if rng.random() < density / (1 + (i - j) / 4)}
                )
                if i
                else []
            )
        fwd = (
            rng.choice([0.0, rng.uniform(1e-3, 1e-2)]) if 0 < i < n - 1 else rng.uniform(1e-3, 1e-2)
        )
        names = []
        if i in (0, n - 1):
            names.append("tied")
        elif rng.random() < 0.7:
            size = rng.choice([16, 32, 64])
            params[f"w{i}"] = Param(f"w{i}", (size, size), "float32", size * size * 4)
            names.append(f"w{i}")
        out = rng.choice([256, 1024, 4096, 16384])
        nodes.append(
            Node(
                id=f"n{i}",
                op="aten.mm.default",
                scope=f"layers.{i}",
                module_type="Linear",
                shape=(4, out // 16),
                dtype="float32",
                out_bytes=out,
                params=tuple(names),
                inputs=("x",) if i == 0 else (),
                requires_grad=rng.random() < 0.8,
                members=(f"n{i}",),
                flops=fwd * 1e12,
                fwd_s=fwd,
                bwd_s=2 * fwd,
                recompute_s=fwd,
                act_bytes=rng.choice([0, 4096, 65536]),
            )
        )
        edges += [Edge(f"n{j}", f"n{i}", nodes[j].out_bytes) for j in preds]
    graph = OpGraph(
        model="random",
        nodes=tuple(nodes),
        edges=tuple(edges),
        params=tuple(params.values()),
        inputs=(ModelInput("x", (4, 16), "float32"),),
        output=f"n{loss % n}",
        profile="analytic",
        hardware="test",
        meta={"optimizer": "adamw", "micro_batch": 1, "batch": 4},
    )
    graph.validate()
    return graph


def hardware(memory: int = GIB, bandwidth: float = 1e9) -> Hardware:
    return Hardware(
        name="test",
        memory_bytes=memory,
        peak_flops=1e12,
        memory_bandwidth=1e11,
        link_bandwidth=bandwidth,
    )


def make_problem(
    graph: OpGraph,
    gpus: int,
    memory: int = GIB,
    bandwidth: float = 1e9,
    schedule: str = "ftpipe",
    seed: int = 0,
) -> Problem:
    return Problem(
        graph, gpus, hardware(memory, bandwidth), schedule, "adamw", micro_batches=4, seed=seed
    )


def crafted_graph(works: list[float], param_bytes: list[int], recompute: bool = False) -> OpGraph:
    """A chain whose node i runs forward in works[i] seconds (and as long again to recompute,
    if asked) and owns param_bytes[i]."""
    nodes, edges, params = [], [], []
    for i, (w, b) in enumerate(zip(works, param_bytes)):
        names = ()
        if b:
            params.append(Param(f"w{i}", (b // 4,), "float32", b))
            names = (f"w{i}",)
        nodes.append(
            Node(
                id=f"n{i}",
                op="aten.mm.default",
                scope=f"layers.{i}",
                module_type="Linear",
                shape=(1,),
                dtype="float32",
                out_bytes=4,
                params=names,
                requires_grad=True,
                members=(f"n{i}",),
                fwd_s=w,
                recompute_s=w if recompute else 0.0,
            )
        )
        if i:
            edges.append(Edge(f"n{i - 1}", f"n{i}", 4))
    return OpGraph(
        model="crafted",
        nodes=tuple(nodes),
        edges=tuple(edges),
        params=tuple(params),
        inputs=(),
        output=f"n{len(works) - 1}",
        profile="analytic",
        hardware="test",
    )


def tied_chain() -> Problem:
    """A problem whose partitioners' cuts the plan's full count finds over (tests of
    `partition/fit.py`): 12 layers of 4 MB weights on 3 GPUs; 1 MB activations; the first and last layers share
    a 2 MB weight (embedding and LM head); a reserve of 1 MB a communicator, 5% fragmentation."""
    graph = crafted_graph([1e-3] * 12, [4 * MB] * 12)
    nodes = [replace(n, out_bytes=MB) for n in graph.nodes]
    for i in (0, -1):
        nodes[i] = replace(nodes[i], params=(*nodes[i].params, "tied"))
    graph = replace(
        graph,
        nodes=tuple(nodes),
        edges=tuple(replace(e, bytes=MB) for e in graph.edges),
        params=(*graph.params, Param("tied", (MB // 2,), "float32", 2 * MB)),
    )
    gpu = replace(
        hardware(bandwidth=1e11),
        memory_reserve=MemoryReserve(communicator_bytes=MB, fragmentation=0.05),
    )
    return Problem(graph, 3, gpu, "ftpipe", "adamw", micro_batches=4)
