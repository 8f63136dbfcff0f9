"""A model's stacks of alike layers exported cut short and copied out give the program the
whole export gives, node for node; where the kept layers cannot show that, the whole model
is exported."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from ftpipe_compiler.graph import repeat
from ftpipe_compiler.graph.trace import _export, inline_regions
from ftpipe_compiler.model.tasks import resolve_task
from ftpipe_compiler.model.zoo import resolve_model

LAYERS = 7  # KEEP exported, the rest copied
COUNTS = ("num_layers", "num_decoder_layers", "num_hidden_layers", "n_layer", "encoder_layers",
          "decoder_layers")  # fmt: skip


def _model(name: str):
    spec = resolve_model(name)
    config = {k: (LAYERS if k in COUNTS else v) for k, v in spec.config.items()}
    spec = replace(spec, config=config)
    task = resolve_task(spec, None)
    args = tuple(spec.example_inputs(task, task.micro_batch, "meta").values())
    return spec.build("meta"), args


def _whole(model, args):
    program = _export(model, args)
    inline_regions(program.graph_module)
    return program


def assert_same_program(got, want) -> None:
    """Node for node: names, ops, arguments, module scopes, traced values; the signature,
    the state and the module calls."""
    a, b = list(got.graph.nodes), list(want.graph.nodes)
    assert [n.name for n in a] == [n.name for n in b]
    for x, y in zip(a, b):
        assert (x.op, x.target, repr(x.args), repr(x.kwargs)) == (
            y.op,
            y.target,
            repr(y.args),
            repr(y.kwargs),
        )
        assert x.meta.get("nn_module_stack") == y.meta.get("nn_module_stack"), x.name
        assert repeat._same_value(x.meta.get("val"), y.meta.get("val")), x.name
    assert got.graph_signature == want.graph_signature
    assert list(got.state_dict) == list(want.state_dict)
    assert [e.fqn for e in got.module_call_graph] == [e.fqn for e in want.module_call_graph]


# BART: its decoder's cross-attention reads the encoder's last layer (no norm after it).
@pytest.mark.parametrize("name", ["t5-tiny", "gpt2-tiny", "llama-tiny", "bert-tiny", "bart-tiny"])
def test_copied_layers_are_the_whole_export(name):
    model, args = _model(name)
    stacks = repeat.repeated_stacks(model)
    assert stacks and all(s.layers == LAYERS for s in stacks)  # T5: encoder and decoder
    exports = []

    def counted(m, a):
        exports.append(sum(len(m.get_submodule(s.path)) for s in stacks))
        return _export(m, a)

    got = repeat.export_repeated(model, args, counted, inline_regions)
    assert exports == [repeat.KEEP * len(stacks)]  # one export, cut short: no fallback
    assert_same_program(got, _whole(model, args))


class _Layer(nn.Module):
    def __init__(self, index: int, flip: bool):
        super().__init__()
        self.layer_idx = index
        self.flip = flip
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x = self.lin(x)
        return -x if self.flip else x


class _Net(nn.Module):
    """Layers alike in everything but what their index makes them do (`odd`: in the code,
    where no setting shows it)."""

    def __init__(self, odd: str):
        super().__init__()
        self.odd = odd
        self.layers = nn.ModuleList(
            _Layer(i, flip=odd == "setting" and i == 5) for i in range(LAYERS)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if self.odd == "code" and layer.layer_idx % 2:
                x = x * 2
        return x.sum()


@pytest.mark.parametrize("odd", ["setting", "code"])
def test_layers_that_differ_are_exported_whole(odd):
    model, args = _Net(odd), (torch.randn(2, 8),)
    if odd == "setting":  # seen in the settings: no stack at all
        assert repeat.repeated_stacks(model) == []
    else:  # alike as modules, told apart by the kept layers' ops
        assert repeat.repeated_stacks(model) == [repeat.Stack("layers", LAYERS)]
    exports = []

    def counted(m, a):
        exports.append(len(m.layers))
        return _export(m, a)

    got = repeat.export_repeated(model, args, counted)
    assert exports[-1] == LAYERS  # exported whole in the end
    assert_same_program(got, _export(model, args))


def test_alike_layers_are_copied():
    model, args = _Net("none"), (torch.randn(2, 8),)
    got = repeat.export_repeated(model, args, _export)
    assert_same_program(got, _export(model, args))
    assert torch.allclose(got.module()(*args), model(*args))
    ops = [n for n in got.graph.nodes if n.op == "call_function"]
    assert len(ops) == LAYERS + 1  # a linear per layer, and the sum
