"""Tracing for packed documents (`--pack`): position ids in, no 2-D mask, the attention masked
by documents; the default trace unchanged; families that cannot keep documents apart refused
with one sentence (OPT takes position ids but builds its mask without them, so its packed
documents would attend to each other: measured 0.15 off in logits; BLOOM takes none). That
the packed trace's stages give each document its loss alone: tests/runtime/data/
test_document_packing.py."""

from __future__ import annotations

import pytest

from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.errors import FtpipeError, TraceError

transformers = pytest.importorskip("transformers")

SHAPE = {"seq_len": 16, "micro_batch": 2}


def test_packed_trace_takes_positions_and_the_default_one_is_unchanged():
    spec, _, traced, graph = costed_graph("llama-tiny", pack=True, **SHAPE)
    assert spec.packed and [i.name for i in graph.inputs] == ["input_ids", "position_ids", "labels"]
    ops = {n.op for n in graph.nodes}
    assert {"aten.cumsum.default", "aten.diff.default"} <= ops  # documents found from positions
    plain = costed_graph("llama-tiny", **SHAPE)[3]
    assert [i.name for i in plain.inputs] == ["input_ids", "attention_mask", "labels"]


def _folder(tmp_path, config):
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_families_that_cannot_keep_documents_apart_are_refused(tmp_path):
    opt = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16,
                                 max_position_embeddings=32, architectures=["OPTForCausalLM"])  # fmt: skip
    with pytest.raises(TraceError, match="its attention does not read a mask made from "
                       "position_ids, so packed documents would attend to each other; leave "
                       "--pack out"):  # fmt: skip
        costed_graph(_folder(tmp_path / "opt", opt), pack=True, **SHAPE)
    bloom = transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2,
                                     architectures=["BloomForCausalLM"])  # fmt: skip
    with pytest.raises(FtpipeError, match="its forward takes no position_ids, which --pack needs"):
        costed_graph(_folder(tmp_path / "bloom", bloom), pack=True, **SHAPE)
    with pytest.raises(FtpipeError, match="--pack packs documents for a causal LM, and t5-tiny "
                       "is a seq2seq-lm model; leave --pack out"):  # fmt: skip
        costed_graph("t5-tiny", pack=True, **SHAPE)
