"""The interface generated stages are written against: declared, versioned, exported."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime import STAGE_API, Param, PipelineConfigError, StageModule


def test_a_stage_lists_param_records_and_builds_them():
    class Stage0(StageModule):
        PARAMS = (
            Param("lin.weight", (3, 2), "float32", True),
            Param("pos", (4,), "int64", False),
            Param("emb.weight", (5, 2), "float32", False, ("head.weight",)),
        )
        FROZEN = ("emb.weight",)

    stage = Stage0()
    assert stage.weight_names() == ["lin.weight", "emb.weight"]
    assert stage.lin.weight.requires_grad and not stage.emb.weight.requires_grad
    assert stage.pos.dtype == torch.int64 and "pos" in dict(stage.named_buffers())


def test_a_stage_from_another_interface_is_refused_in_one_sentence():
    with pytest.raises(PipelineConfigError, match=f"stage interface {STAGE_API + 1}.*compile"):

        class Old(StageModule):
            API = STAGE_API + 1


def test_custom_ops_come_from_their_module_or_one_sentence():
    """A package whose stages call a custom op imports the module that defines it; where that
    module is missing, one sentence says which and what to install."""
    from ftpipe_runtime.stage.api import import_ops

    import_ops(["json"])  # importable: nothing said
    with pytest.raises(PipelineConfigError) as e:
        import_ops(["ftpipe_no_such_module.ops"])
    said = str(e.value)
    assert "custom ops defined in ftpipe_no_such_module.ops" in said
    assert "pip install 'ftpipe[hf]'" in said and "\n" not in said
