"""From a Plan over graph nodes to what each generated stage computes and sends.

A plan speaks of graph nodes (one ATen call, or a whole layer at `layer` granularity); code
speaks of traced fx values. `wire()` maps every traced value to its stage and finds the
*wires*: the tensors that really cross between stages. They differ from the plan's transfers
in two ways the runtime must see:

- a layer node may send several values (the hidden state and T5's position bias), each its
  own wire, named by the traced value;
- a tuple never crosses: the `getitem` that picks an element runs in the producing stage and
  the element is sent (tensors go over the wire, tuples do not);
- a parameter read by several stages is a wire too, named by the parameter: its owner (the
  plan's, the lowest stage reading it) holds it and sends it, the others receive it;
- a node a stage recomputes (the plan's `copies`: partition/remat) is computed in that stage
  as well as in its own, so its values do not cross to that stage.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from ftpipe_runtime.spec.plan import Plan as RuntimePlan
from torch import fx

from ..errors import FtpipeError
from ..graph.opgraph import OpGraph
from ..graph.trace import Traced
from ..plan import Plan


@dataclass(frozen=True)
class Wire:
    """A value (tensor or parameter) that crosses from one stage to others."""

    name: str  # the traced value's name: what the plan.json of the package calls the tensor
    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    requires_grad: bool
    node: str  # the graph node (plan level) that produces it, or the parameter's name
    weight: bool = False  # a parameter sent by the stage that owns it

    def to_json(self) -> dict:
        return {
            "tensor": self.name,
            "producer": self.producer,
            "consumers": list(self.consumers),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "requires_grad": self.requires_grad,
        }


@dataclass
class StageWiring:
    """One generated stage: the traced nodes it runs, what it owns, receives and sends."""

    id: int
    gpu: int
    nodes: list[fx.Node] = field(default_factory=list)  # in execution order
    model_inputs: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # canonical names it owns, by first use
    inputs: list[str] = field(default_factory=list)  # wires received
    outputs: list[str] = field(default_factory=list)  # wires sent
    is_loss: bool = False


@dataclass
class Wiring:
    """A plan mapped onto the traced program: its stages and the wires between them."""

    stages: list[StageWiring]
    wires: dict[str, Wire]
    loss: fx.Node
    requires_grad: dict[str, bool]  # per traced value


def wire(traced: Traced, graph: OpGraph, plan: Plan) -> Wiring:
    fx_graph = traced.program.graph
    stage_of, node_of, copies_of, loss = _placement(fx_graph, graph, plan)
    grad = _requires_grad(fx_graph, traced.placeholders, {p.name: p.trainable for p in plan.params})
    stages = {
        st.id: StageWiring(st.id, st.gpu, is_loss=st.id == plan.loss_stage) for st in plan.stages
    }
    input_order = list(plan.model.get("inputs") or [])
    owner = {p.name: p.stages[0] for p in plan.params if p.stages}
    producers: dict[str, set[int]] = {}
    readers: dict[str, set[int]] = {}  # parameter -> stages receiving it from its owner
    runs = (
        (n, s)
        for n in fx_graph.nodes
        if n.name in stage_of
        for s in (stage_of[n.name], *sorted(copies_of.get(n.name, ())))
    )
    for n, s in runs:
        st = stages[s]
        st.nodes.append(n)
        for a in _args(n):
            if a.op == "placeholder":
                kind, name = traced.placeholders[a.name]
                if kind == "param" and owner.get(name, s) != s:
                    if owner[name] > s:
                        raise FtpipeError(
                            f"stage {s} reads {name}, owned by the later {owner[name]}"
                        )
                    readers.setdefault(name, set()).add(s)
                    continue
                bucket = st.params if kind == "param" else st.model_inputs
                if name not in bucket:
                    bucket.append(name)
            elif a.op == "call_function":
                t = s if s in copies_of.get(a.name, ()) else stage_of[a.name]
                if t > s:
                    raise FtpipeError(f"stage {s} reads {a.name} from the later stage {t}")
                if t != s:
                    producers.setdefault(a.name, set()).add(s)
    wires = {}
    for p in plan.params:  # placeholders come first in the program: so do their wires
        if p.name in readers:
            if p.name not in stages[owner[p.name]].params:
                raise FtpipeError(
                    f"the plan says stage {owner[p.name]} owns {p.name}, unread there"
                )
            wires[p.name] = _weight_wire(p, owner[p.name], readers[p.name])
    for n in fx_graph.nodes:
        if n.name in producers:
            wires[n.name] = _wire(n, stage_of[n.name], producers[n.name], grad[n.name], node_of)
    for st in stages.values():
        st.model_inputs.sort(
            key=lambda x: input_order.index(x) if x in input_order else len(input_order)
        )
    for w in wires.values():
        stages[w.producer].outputs.append(w.name)
        for c in w.consumers:
            stages[c].inputs.append(w.name)
    return Wiring([stages[k] for k in sorted(stages)], wires, loss, grad)


def _placement(fx_graph: fx.Graph, graph: OpGraph, plan: Plan):
    """Each traced value's stage, its graph node, the other stages recomputing it (the
    plan's `copies`), and the loss value. A tuple's `getitem` runs where the tuple is made."""
    by_name = {n.name: n for n in fx_graph.nodes}
    stage_of: dict[str, int] = {}
    node_of: dict[str, str] = {}  # traced value -> graph node id
    copies_of: dict[str, set[int]] = {}  # traced value -> stages recomputing it
    for st in plan.stages:
        for nid in st.nodes:
            for member in graph.node[nid].members:
                stage_of[member] = st.id
                node_of[member] = nid
        for nid in st.copies:
            for member in graph.node[nid].members:
                copies_of.setdefault(member, set()).add(st.id)
    out = next(n for n in fx_graph.nodes if n.op == "output")
    loss = out.args[0][0]
    if stage_of.get(loss.name) != plan.loss_stage:
        raise FtpipeError(
            "the plan's loss stage does not compute the loss; was it made for this graph?"
        )
    for n in fx_graph.nodes:  # in order, so chains of getitem follow their final source
        if n.op == "call_function" and n.target is operator.getitem and n.name in stage_of:
            src = n.args[0]
            if src.name in stage_of and stage_of[src.name] != stage_of[n.name]:
                stage_of[n.name] = stage_of[src.name]
            if src.name in copies_of:  # an element of a recomputed tuple: recomputed too
                copies_of.setdefault(n.name, set()).update(copies_of[src.name])
    for name, where in copies_of.items():
        where.discard(stage_of.get(name))
    missing = [m for m in stage_of if m not in by_name]
    if missing:
        raise FtpipeError(f"the plan names traced values {missing[:3]} the program does not have")
    return stage_of, node_of, copies_of, loss


def _wire(n: fx.Node, producer: int, consumers: set[int], grad: bool, node_of) -> Wire:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise FtpipeError(
            f"{n.name} ({type(val).__name__}) would cross between stages, but only tensors can; "
            "try another partitioner or --granularity layer"
        )
    dtype = str(val.dtype).removeprefix("torch.")
    return Wire(
        name=n.name,
        producer=producer,
        consumers=tuple(sorted(consumers)),
        shape=tuple(int(s) for s in val.shape),
        dtype=dtype,
        bytes=val.numel() * val.element_size(),
        requires_grad=grad and val.is_floating_point(),
        node=node_of.get(n.name, n.name),
    )


def _weight_wire(p, owner: int, readers: set[int]) -> Wire:
    return Wire(
        name=p.name,
        producer=owner,
        consumers=tuple(sorted(readers)),
        shape=tuple(p.shape),
        dtype=p.dtype,
        bytes=p.bytes,
        requires_grad=p.trainable and getattr(torch, p.dtype).is_floating_point,
        node=p.name,
        weight=True,
    )


def _requires_grad(fx_graph: fx.Graph, placeholders, trainable: dict[str, bool]) -> dict[str, bool]:
    """Does a gradient flow into each traced value? (floating, and fed by a trainable weight)"""
    grad: dict[str, bool] = {}
    for n in fx_graph.nodes:
        if n.op == "placeholder":
            kind, name = placeholders.get(n.name, ("input", n.name))
            grad[n.name] = kind == "param" and trainable.get(name, False)
        elif n.op == "call_function":
            val = n.meta.get("val")
            floating = not isinstance(val, torch.Tensor) or val.is_floating_point()
            grad[n.name] = floating and any(grad.get(a.name, False) for a in _args(n))
    return grad


def _args(n: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def package_plan(plan: Plan, wiring: Wiring, extra_model: dict, generated_by: str) -> dict:
    """The plan as the package runs it: the same schema, with wires as the transfers; read
    back through the runtime's one reader (checked as the runtime will check it), so the
    JSON written is what `Plan.from_dict(...).to_dict()` gives back, key for key."""
    d = plan.to_dict()
    d["generated_by"] = generated_by
    d["model"] = {**d["model"], **extra_model}
    d["transfers"] = [w.to_json() for w in wiring.wires.values()]
    for sd, st in zip(d["stages"], wiring.stages):
        sd["inputs"] = list(st.inputs)
        sd["outputs"] = list(st.outputs)
        sd["model_inputs"] = list(st.model_inputs)
    d["wires"] = {w.name: w.node for w in wiring.wires.values()}
    return RuntimePlan.from_dict(d).to_dict()
