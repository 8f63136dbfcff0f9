"""Write the pipeline package: stages.py, plan.json, __init__, __main__, README.

    generate_package(traced, graph, plan, spec, Path("out"), command="ftpipe compile ...")
    # -> out/t5_tiny_pipeline/

The package is written into a temporary folder next to its destination and swapped in at
the end (`output_folder`), so a failure never leaves half a package behind.
"""

from __future__ import annotations

import json
import keyword
import math
import os
import shlex
from pathlib import Path

import jinja2
import torch
from ftpipe_runtime.atomic import atomic_open, write_atomic
from ftpipe_runtime.spec.weights import WRAPPER_PREFIX, parameters_on_meta
from ftpipe_runtime.stage.api import STAGE_API
from torch import nn

from ..costs.analytic import backward_factor
from ..costs.hardware import get_hardware
from ..errors import FtpipeError, OutputExistsError
from ..graph.opgraph import OpGraph
from ..graph.trace import Traced
from ..model.zoo import ModelSpec
from ..output import output_folder
from ..plan import Plan
from ..resources import templates_dir
from ..units import gib, mib
from ..version import __version__
from .emit import StageEmitter, value_names
from .source import Source, finalize, identifier, literal
from .summary import describe
from .wiring import package_plan, wire

TEMPLATES = ("stages.py", "__init__.py", "__main__.py", "README.md")


def package_name(spec) -> str:
    """The generated package's folder and module: a Python identifier made of the model's
    name (a folder's name can hold anything: quotes, newlines, `..`)."""
    return identifier(spec.name.lower(), default="model", lead="m") + "_pipeline"


def generate_package(
    traced: Traced,
    graph: OpGraph,
    plan: Plan,
    spec: ModelSpec,
    out_dir: Path,
    command: str,
    force: bool = False,
) -> Path:
    """Render `plan` into `out_dir/<spec.package_name>/`; returns that folder."""
    out_dir = Path(out_dir)
    final = out_dir / package_name(spec)
    if final.exists() and not force:
        raise OutputExistsError(
            f"{final} already exists; pass --force to replace it, or choose another output folder"
        )
    wiring = wire(traced, graph, plan)
    names = value_names(
        traced.program.graph,
        traced.placeholders,
        list(plan.model.get("inputs") or []),
        [w.name for w in wiring.wires.values() if w.weight],
    )
    info = {p.name: p for p in plan.params}
    compute = getattr(torch, graph.meta.get("compute_dtype", "float32"))
    command = portable_command(command, out_dir)
    generated_by = f"ftpipe {__version__}: {command}"
    stages, uses_operator, op_modules = _stage_contexts(traced, wiring, names, info, compute)
    buffers = _buffer_values(
        traced,
        spec,
        [
            p.name
            for p in plan.params
            if not (p.trainable or p.frozen) and any(p.name in st.params for st in wiring.stages)
        ],
    )
    # Paths relative to the package: no path of this machine is baked in, so the package
    # runs wherever it is copied with its model beside it (or `--weights DIR`).
    model_dir = _relative(spec.path, final) if spec.path else ""
    extra = {"path": model_dir} if spec.path else {}
    extra |= _rates(graph, plan)
    given = str(plan.model.get("spec") or "")
    if os.path.isabs(given):  # a folder named on the command line
        extra["spec"] = _relative(given, final)
    pplan = package_plan(plan, wiring, extra, generated_by)
    if "command" in pplan:
        pplan["command"] = command
    context = {
        "generated_by": generated_by,
        "command": command,
        "version": __version__,
        "package": package_name(spec),
        "model_name": spec.name,
        "plan": pplan,
        "stages": stages,
        "uses_operator": uses_operator,
        "op_modules": op_modules,
        "has_buffers": bool(buffers),
        "weights_dir": model_dir if _has_safetensors(spec.path) else "",
        "traced_dtype": str(compute).removeprefix("torch."),
        "stage_api": STAGE_API,
        "launch": _launch(plan),
    }
    files = _render(context)
    files["plan.json"] = json.dumps(pplan, indent=1) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(final, files, buffers, generated_by)
    return final


def _stage_contexts(traced: Traced, wiring, names, info, compute) -> tuple[list[dict], bool, list]:
    """What the templates need of each stage (its straight-line body, what it holds,
    receives and sends), whether any body uses the `operator` module, and the modules that
    define the custom ops the bodies call."""
    stages = []
    uses_operator = False
    op_modules: set[str] = set()
    summaries = describe(wiring.stages)
    for st in wiring.stages:
        emitter = StageEmitter(
            st,
            wiring,
            names,
            traced.placeholders,
            lambda n: param_expr(n, info[n].trainable or info[n].frozen),
            compute,
        )
        body = emitter.body()
        uses_operator |= emitter.uses_operator
        op_modules |= emitter.op_modules
        stages.append(
            {
                "id": st.id,
                "gpu": st.gpu,
                "is_loss": st.is_loss,
                "held": summaries[st.id],
                "inputs": py_tuple(st.model_inputs + st.inputs),
                "outputs": py_tuple(["loss"] * st.is_loss + st.outputs),
                "params": [_param_row(info[p]) for p in st.params],
                "frozen": py_tuple([p for p in st.params if info[p].frozen]),
                "n_params": sum(math.prod(info[p].shape) for p in st.params if info[p].trainable),
                # The emitter's code, its names escaped (`source`): split at its own newlines.
                "body": [Source(ln) for line in body for ln in line.split("\n")],
                "receives": [(w, wiring.wires[w].producer) for w in st.inputs],
                "sends": [(w, wiring.wires[w].consumers) for w in st.outputs],
            }
        )
    return stages, uses_operator, sorted(op_modules)


def _render(context: dict) -> dict[str, str]:
    """The package's files rendered from templates/package/*.j2: every value a template
    prints goes through `source` (`| py` for a literal, else as text by `finalize`)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir() / "package")),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=finalize,
    )
    env.filters["py"] = literal
    env.filters["thousands"] = lambda n: f"{n:,}"
    env.filters["figure"] = _figure
    env.filters["gib"] = lambda n: f"{gib(n):,.2f}" if _number(n) else ""
    env.filters["mib"] = lambda n: f"{mib(n):,.2f}" if _number(n) else ""
    files = {name: env.get_template(f"{name}.j2").render(**context) for name in TEMPLATES}
    return files


def param_expr(name: str, parameter: bool) -> str:
    """`self.encoder.block[3].layer[0].SelfAttention.q.weight`, or a lookup by name when a
    part cannot be an attribute (a keyword, or a name nn.Module already uses)."""
    from ftpipe_runtime.stage.api import Scope, StageModule

    parts = name.split(".")
    taken = set(dir(StageModule)) | set(dir(Scope)) | {"training"}
    ok = (
        not parts[0].isdigit()
        and not parts[-1].isdigit()
        and all(
            p.isdigit() or (p.isidentifier() and not keyword.iskeyword(p) and p not in taken)
            for p in parts
        )
    )
    if not ok:
        return f"self.get_{'parameter' if parameter else 'buffer'}({literal(name)})"
    return "self" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts)


def py_tuple(items) -> Source:
    """A tuple of strings as source with double quotes: ("a", "b") or ("a",)."""
    return literal(tuple(items))


def _param_row(p) -> Source:
    row = (p.name, tuple(p.shape), p.dtype, p.trainable, tuple(p.aliases))
    return Source(f"Param{literal(row)}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _figure(v) -> str:
    """Numbers for the README: 4 significant digits, thousands separated."""
    if not _number(v):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:,.4g}"


def _relative(path, start: Path) -> str:
    """`path` relative to the folder `start` (which need not exist yet), POSIX-style."""
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()


def portable_command(command: str, base: Path) -> str:
    """The compile command for the headers, its absolute paths made relative to `base` (the
    folder holding the package, where its README runs it from): no generated file names a
    path of the machine that compiled it."""
    try:
        words = shlex.split(command)
    except ValueError:  # not a shell line (a caller's own text): said as it is
        return command
    out = []
    for word in words:
        flag, eq, value = word.partition("=") if word.startswith("-") else ("", "", word)
        if os.path.isabs(value):
            value = _relative(value, base)
        out.append(flag + eq + value)
    return shlex.join(out) if out != words else command


def _launch(plan: Plan) -> dict:
    """The README's multi-node launch: the plan's nodes where it was made for a cluster,
    else its processes over two nodes where they split evenly."""
    world = plan.world
    if plan.cluster is not None:
        per_node = min(plan.cluster.gpus_per_node, world)
    else:
        per_node = world // 2 if world > 1 and world % 2 == 0 else 1
    return {"world": world, "per_node": per_node, "nodes": -(-world // per_node)}


def _rates(graph: OpGraph, plan: Plan) -> dict:
    """What the runtime's MFU needs: the model FLOPs of one micro-batch (forward and
    backward, no recompute; 0 where the profile counted none) and the compiled hardware's
    peak FLOP/s per dtype ("tf32": fp32 matrix products on tensor cores)."""
    flops = sum(
        n.flops * (1.0 + (backward_factor(graph, n) if n.requires_grad else 0.0))
        for n in graph.nodes
    )
    try:
        hw = get_hardware(str(plan.model.get("hardware") or ""))
    except FtpipeError:  # a plan from elsewhere: no peak, no MFU
        return {"flops_per_micro_batch": flops}
    peaks = {"float32": hw.peak_flops, "tf32": hw.peak_flops_tf32, **dict(hw.peak_flops_16bit)}
    return {"flops_per_micro_batch": flops, "peak_flops": {k: v for k, v in peaks.items() if v}}


def _has_safetensors(path: str) -> bool:
    return bool(path) and any(Path(path).glob("*.safetensors"))


def _buffer_values(traced: Traced, spec: ModelSpec, names: list[str]) -> dict[str, torch.Tensor]:
    """Values of the non-trainable tensors the stages hold (position ids...).

    A program traced on a real device has them; one traced on `meta` does not, so the model
    is built once more on the CPU with its parameters on `meta` (no memory for weights).
    """
    if not names:
        return {}
    program = traced.program
    found: dict[str, torch.Tensor] = {}
    for s in program.graph_signature.input_specs:
        kind, canonical = traced.placeholders.get(s.arg.name, ("input", ""))
        value = program.state_dict.get(s.target, program.constants.get(s.target))
        if (
            kind == "param"
            and canonical in names
            and isinstance(value, torch.Tensor)
            and value.device.type != "meta"
        ):
            found[canonical] = value.detach().cpu().clone()
    missing = [n for n in names if n not in found]
    if missing:
        with parameters_on_meta():
            model = spec.build("cpu", dropout=0.0)
        held = _tensors(model)
        _initialise_frozen(model, [n for n in missing if n in held and held[n].is_meta])
        held = _tensors(model)
        for n in missing:
            if n not in held or held[n].device.type == "meta":
                raise FtpipeError(f"cannot recover the value of the constant {n}; trace on the CPU")
            found[n] = held[n].detach().clone()
    return found


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_buffers(remove_duplicate=False)]
    named += model.named_parameters(remove_duplicate=False)
    return {k.removeprefix(WRAPPER_PREFIX): v for k, v in named}


@torch.no_grad()
def _initialise_frozen(model: nn.Module, names: list[str]) -> None:
    """Frozen parameters (Pegasus's sinusoidal positions) went to `meta` with the others:
    give the modules holding them real tensors and let the model initialise those modules."""
    init = getattr(model.m, "_init_weights", None) if hasattr(model, "m") else None
    for name in names:
        owner = model.get_submodule(WRAPPER_PREFIX + name.rpartition(".")[0])
        if init is not None:
            owner.to_empty(device="cpu", recurse=False)
            init(owner)


def _write_atomically(final: Path, files: dict[str, str], buffers: dict, generated_by: str):
    needs = sum(len(t.encode()) for t in files.values()) + sum(t.nbytes for t in buffers.values())
    with output_folder(final, force=True, needs=needs) as tmp:
        for name, text in files.items():
            write_atomic(tmp / name, text)
        if buffers:
            with atomic_open(tmp / "buffers.pt", "wb") as f:
                torch.save({"generated_by": generated_by, "tensors": buffers}, f)
