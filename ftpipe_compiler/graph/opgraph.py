"""The operator graph: what tracing produces and every later step consumes.

    traced = trace_model(spec, task, micro_batch=4)  # traced.graph: an OpGraph, no costs yet
    graph = analytic_costs(traced, hw, "layer")      # the graph with its costs filled in
    graph.to_json() / OpGraph.from_json(d)           # the `ftpipe profile -o graph.json` file

A node is one ATen call (``op`` granularity) or a group of them collapsed to a module
scope (``layer`` granularity). Model inputs and parameters are not nodes: a node lists the
model inputs and the (canonical) parameters it reads. Edges carry the bytes of the tensor
that flows along them.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace

import torch
from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.spec.plan import step_work_s
from ftpipe_runtime.spec.records import from_json as _typed
from ftpipe_runtime.spec.topology import read_json as _read_json

from ..errors import FtpipeError, PlanFormatError
from ..version import GRAPH_FORMAT


@dataclass(frozen=True)
class Node:
    id: str
    op: str  # ATen target ("aten.linear.default") or "layer" for a collapsed group
    scope: str  # module path without the wrapper prefix: "encoder.block.3.layer.0"
    module_type: str  # class name of the innermost module: "T5LayerFF"
    shape: tuple[int, ...]  # first output
    dtype: str
    out_bytes: int  # all outputs together
    params: tuple[str, ...] = ()  # canonical names of parameters read
    inputs: tuple[str, ...] = ()  # model inputs read ("input_ids", "labels")
    requires_grad: bool = False
    members: tuple[str, ...] = ()  # traced node names, in execution order
    # Costs: zero until a profiler fills them in.
    flops: float = 0.0  # forward
    bytes_moved: float = 0.0  # forward memory traffic
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    wgrad_s: float = 0.0  # the part of bwd_s computing weight gradients (a split backward's W)
    recompute_s: float = 0.0
    act_bytes: int = 0  # kept for backward when not recomputing


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    bytes: int


@dataclass(frozen=True)
class Param:
    name: str  # canonical name (first in model.named_parameters())
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)
    trainable: bool = True
    frozen: bool = False  # a weight of the model that does not train (not a buffer)


@dataclass(frozen=True)
class ModelInput:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class OpGraph:
    model: str  # the model spec given on the command line
    nodes: tuple[Node, ...]  # in a topological (execution) order
    edges: tuple[Edge, ...]
    params: tuple[Param, ...]
    inputs: tuple[ModelInput, ...]
    output: str  # id of the node producing the loss
    granularity: str = "op"
    profile: str = "none"  # none | analytic | measured
    hardware: str = ""
    meta: dict = field(default_factory=dict, compare=False)  # task, micro-batch, dtype...

    # --- lookups (cached: the graph is immutable) ---
    @functools.cached_property
    def node(self) -> dict[str, Node]:
        return {n.id: n for n in self.nodes}

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {n.id: i for i, n in enumerate(self.nodes)}

    @functools.cached_property
    def param(self) -> dict[str, Param]:
        return {p.name: p for p in self.params}

    @functools.cached_property
    def nx(self):
        """The graph as a networkx.DiGraph (imported here: a compile never needs it)."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(n.id for n in self.nodes)
        for e in self.edges:
            g.add_edge(e.src, e.dst, bytes=e.bytes)
        return g

    @functools.cached_property
    def preds(self) -> dict[str, tuple[str, ...]]:
        return self._neighbours(lambda e: (e.dst, e.src))

    @functools.cached_property
    def succs(self) -> dict[str, tuple[str, ...]]:
        return self._neighbours(lambda e: (e.src, e.dst))

    def _neighbours(self, ends) -> dict[str, tuple[str, ...]]:
        """Node -> the other end of its edges, in edge order (`ends(e)`: (node, other))."""
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            a, b = ends(e)
            out[a].append(b)
        return {k: tuple(v) for k, v in out.items()}

    def derived(self, key: str, make):
        """`make(self)`, made once per graph and key (the graph never changes): what a search
        derives from the graph alone, asked again for each of its problems."""
        kept = self.__dict__.setdefault("_derived", {})
        if key not in kept:
            kept[key] = make(self)
        return kept[key]

    @functools.cached_property
    def owner(self) -> dict[str, str]:
        """Parameter name -> the node that holds it: the first reader in execution order."""
        own: dict[str, str] = {}
        for n in self.nodes:
            for p in n.params:
                own.setdefault(p, n.id)
        return own

    # --- totals ---
    @property
    def num_parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.trainable)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.params if p.trainable)

    @property
    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def work(self, n: Node, recompute: bool = True) -> float:
        """Seconds of compute a node costs per micro-batch in one training step."""
        return step_work_s(n.fwd_s, n.bwd_s, n.recompute_s, recompute)

    def with_nodes(self, nodes, **changes) -> OpGraph:
        return replace(self, nodes=tuple(nodes), **changes)

    # --- checks ---
    def validate(self) -> None:
        ids = self.index
        # Every edge forwards in node order means no cycle; only a graph with an edge going
        # back is asked whether it has one (the clearer message).
        back = next((e for e in self.edges if ids[e.src] >= ids[e.dst]), None)
        if back is not None:
            import networkx as nx

            if not nx.is_directed_acyclic_graph(self.nx):
                raise FtpipeError("the operator graph has a cycle; this is a bug in tracing")
            raise FtpipeError(f"edge {back.src}->{back.dst} goes against the node order")
        names = [p.name for p in self.params] + [a for p in self.params for a in p.aliases]
        if len(names) != len(set(names)):
            raise FtpipeError("a parameter name appears twice (tied weights not merged)")
        known = set(self.param)
        for n in self.nodes:
            costs = (n.flops, n.bytes_moved, n.fwd_s, n.bwd_s, n.wgrad_s, n.recompute_s)
            if not all(math.isfinite(c) and c >= 0 for c in costs):
                raise FtpipeError(f"node {n.id} has a negative or non-finite cost")
            unknown = set(n.params) - known
            if unknown:
                raise FtpipeError(f"node {n.id} reads unknown parameters {sorted(unknown)}")
        if self.output not in self.node:
            raise FtpipeError(f"output node {self.output!r} is not in the graph")

    # --- serialisation ---
    def to_json(self) -> dict:
        return {
            "format": GRAPH_FORMAT,
            "kind": "ftpipe-graph",
            "model": self.model,
            "granularity": self.granularity,
            "profile": self.profile,
            "hardware": self.hardware,
            "output": self.output,
            "meta": self.meta,
            "inputs": [asdict(i) for i in self.inputs],
            "params": [asdict(p) for p in self.params],
            "nodes": [asdict(n) for n in self.nodes],
            "edges": [[e.src, e.dst, e.bytes] for e in self.edges],
        }

    @classmethod
    def from_json(cls, d: dict) -> OpGraph:
        if not isinstance(d, dict) or d.get("kind") != "ftpipe-graph":
            raise PlanFormatError(
                "this file is not an ftpipe graph; make one with `ftpipe profile`"
            )
        if d.get("format") != GRAPH_FORMAT:
            raise PlanFormatError(
                f"graph file format {d.get('format')} is not the format {GRAPH_FORMAT} this "
                "ftpipe reads; profile the model again with this version"
            )
        try:
            return _typed(
                cls,
                {k: d[k] for k in ("model", "granularity", "profile", "hardware", "output")}
                | {
                    "meta": d.get("meta", {}),
                    "inputs": tuple(_typed(ModelInput, i) for i in d["inputs"]),
                    "params": tuple(_typed(Param, p) for p in d["params"]),
                    "nodes": tuple(_typed(Node, n) for n in d["nodes"]),
                    "edges": tuple(
                        _typed(Edge, dict(zip(("src", "dst", "bytes"), e))) for e in d["edges"]
                    ),
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanFormatError(
                f"the graph file is incomplete or damaged ({type(e).__name__}: {e}); profile the "
                "model again (ftpipe profile -o)"
            ) from None

    def save(self, path) -> None:
        write_atomic(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path) -> OpGraph:
        graph = cls.from_json(read_json(path, "graph"))
        try:
            graph.validate()
        except (FtpipeError, KeyError) as e:  # KeyError: an edge to a node that is not there
            raise PlanFormatError(f"{path} is not a valid graph: {e}") from None
        return graph


def read_json(path, what: str) -> dict:
    """Read a JSON file or raise one clear sentence about why it cannot be used (the
    runtime's reader: one wording for a damaged file on both sides)."""
    try:
        return _read_json(path, what, "write it again")
    except PipelineConfigError as e:
        raise PlanFormatError(str(e)) from None


def dtype_bytes(dtype: str) -> int:
    """`dtype_bytes("float32")` -> 4."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()
