import json

import pytest

from ftpipe_compiler.errors import PlanFormatError
from ftpipe_compiler.graph.opgraph import OpGraph


def test_json_round_trip(tiny_t5_costed, tmp_path):
    graph = tiny_t5_costed
    again = OpGraph.from_json(json.loads(json.dumps(graph.to_json())))
    assert again == graph
    path = tmp_path / "g.json"
    graph.save(path)
    assert OpGraph.load(path) == graph


def test_other_format_is_refused(tiny_t5_costed, tmp_path):
    d = tiny_t5_costed.to_json()
    d["format"] = 99
    with pytest.raises(PlanFormatError, match="format 99"):
        OpGraph.from_json(d)


def test_truncated_and_missing_files(tiny_t5_costed, tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(tiny_t5_costed.to_json())[:500])
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        OpGraph.load(path)
    with pytest.raises(PlanFormatError, match="does not exist"):
        OpGraph.load(tmp_path / "nope.json")


def test_derived_is_made_once_per_graph(tiny_t5_costed):
    g = tiny_t5_costed
    made = []

    def make(graph):
        made.append(graph)
        return len(graph.nodes)

    assert g.derived("count", make) == g.derived("count", make) == len(g.nodes)
    assert made == [g]  # once, then kept
    other = g.with_nodes(g.nodes[:-1])  # another graph: its own
    assert other.derived("count", make) == len(g.nodes) - 1
    assert made == [g, other]
    assert g.derived("count", make) == len(g.nodes) and len(made) == 2
