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
