"""The operator graph: what tracing produces and every later step consumes.

    graph = trace(spec, task)               # OpGraph, no costs yet
    graph = analytic_costs(graph, hw)       # same graph, costs filled in
    graph.to_json() / OpGraph.from_json(d)  # the `ftpipe profile -o graph.json` file

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

import networkx as nx
import torch

from .errors import FtpipeError, PlanFormatError
from .version import GRAPH_FORMAT


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
    def nx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(n.id for n in self.nodes)
        for e in self.edges:
            g.add_edge(e.src, e.dst, bytes=e.bytes)
        return g

    @functools.cached_property
    def preds(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            out[e.dst].append(e.src)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def succs(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            out[e.src].append(e.dst)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def owner(self) -> dict[str, str]:
        """Parameter name -> the node that holds it: the first reader in execution order."""
        own: dict[str, str] = {}
        for n in self.nodes:
            for p in n.params:
                own.setdefault(p, n.id)
        return own

    def node_by_scope(self, scope: str) -> Node:
        """The first node whose scope is `scope` (layer granularity: the whole layer)."""
        return next(n for n in self.nodes if n.scope == scope)

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
        return n.fwd_s + n.bwd_s + (n.recompute_s if recompute else 0.0)

    def with_nodes(self, nodes, **changes) -> OpGraph:
        return replace(self, nodes=tuple(nodes), **changes)

    # --- checks ---
    def validate(self) -> None:
        if not nx.is_directed_acyclic_graph(self.nx):
            raise FtpipeError("the operator graph has a cycle; this is a bug in tracing")
        ids = self.index
        for e in self.edges:
            if ids[e.src] >= ids[e.dst]:
                raise FtpipeError(f"edge {e.src}->{e.dst} goes against the node order")
        names = [p.name for p in self.params] + [a for p in self.params for a in p.aliases]
        if len(names) != len(set(names)):
            raise FtpipeError("a parameter name appears twice (tied weights not merged)")
        known = set(self.param)
        for n in self.nodes:
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
        return cls(
            model=d["model"],
            granularity=d["granularity"],
            profile=d["profile"],
            hardware=d["hardware"],
            output=d["output"],
            meta=d.get("meta", {}),
            inputs=tuple(ModelInput(i["name"], tuple(i["shape"]), i["dtype"]) for i in d["inputs"]),
            params=tuple(_tupled(Param, p) for p in d["params"]),
            nodes=tuple(_tupled(Node, n) for n in d["nodes"]),
            edges=tuple(Edge(s, t, b) for s, t, b in d["edges"]),
        )

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path) -> OpGraph:
        return cls.from_json(read_json(path, "graph"))


def read_json(path, what: str) -> dict:
    """Read a JSON file or raise one clear sentence about why it cannot be used."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise PlanFormatError(f"{what} file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFormatError(
            f"{what} file {path} is not valid JSON (truncated or damaged? {e.msg} at line "
            f"{e.lineno if hasattr(e, 'lineno') else '?'}); write it again"
        ) from None


def _tupled(cls, d: dict):
    """Build a frozen dataclass from JSON, turning lists back into tuples."""
    return cls(**{k: _to_tuple(v) for k, v in d.items()})


def _to_tuple(v):
    return tuple(_to_tuple(x) for x in v) if isinstance(v, list) else v


def dtype_bytes(dtype: str) -> int:
    """`dtype_bytes("float32")` -> 4."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()
