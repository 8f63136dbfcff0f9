"""PipeTransformer's freeze rule (§3.1, eq. 1) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
from ftpipe_runtime.freeze.layers import (
    bound_schedule,
    frozen_bound,
    layer_of,
    layer_units,
    next_frozen,
)


def test_bound_is_alpha_of_the_active_layers_rounded_down():
    # 24 layers, alpha 1/3: 0 + 24/3 = 8; 8 + 16/3 = 13.33; 13 + 11/3 = 16.67; 16 + 8/3 = 18.67
    assert frozen_bound(0, 24, 1 / 3) == 8
    assert frozen_bound(8, 24, 1 / 3) == 13
    assert bound_schedule(24, 1 / 3, 5) == (8, 13, 16, 18, 20)
    # 12 layers, alpha 1/5: 2.4 -> 2; 2 + 2 = 4; 4 + 1.6 = 5.6 -> 5
    assert bound_schedule(12, 1 / 5, 3) == (2, 4, 5)
    # 8 + (1/3) * 15 is 13 exactly, not 12.999...
    assert frozen_bound(8, 23, 1 / 3) == 13
    # the bound never reaches all layers: with 1 active layer left nothing more freezes
    assert frozen_bound(23, 24, 1 / 2) == 23


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5])
def test_alpha_outside_zero_one_is_refused(alpha):
    with pytest.raises(ValueError, match="alpha"):
        frozen_bound(0, 24, alpha)


def test_gradient_term_freezes_the_layers_before_the_smallest_norm():
    norms = [5.0, 4.0, 3.0, 0.5, 2.0, 1.0, 6.0, 7.0]  # smallest: layer 3
    # bound 0 + 8/2 = 4 does not limit: layers 0, 1, 2 (those preceding layer 3) freeze
    assert next_frozen(0, norms, 1 / 2) == 3
    # alpha 1/4: bound 2 limits
    assert next_frozen(0, norms, 1 / 4) == 2


def test_only_active_layers_are_candidates():
    norms = [0.0, 0.0, 3.0, 2.5, 2.0, 9.0, 8.0, 7.0]  # layers 0, 1 frozen: their norms are 0
    # active 2..7, smallest layer 4; bound 2 + 6/2 = 5
    assert next_frozen(2, norms, 1 / 2) == 4
    # the first active layer the smallest: nothing more freezes
    assert next_frozen(2, [0, 0, 0.1, 1, 1, 1, 1, 1], 1 / 2) == 2


def test_ties_take_the_lowest_layer_and_nan_counts_as_infinite():
    assert next_frozen(0, [1.0, 0.2, 0.2, 1.0], 0.9) == 1
    assert next_frozen(0, [math.nan, math.nan, 0.3, 1.0], 0.9) == 2


def test_layers_of_parameter_names():
    assert layer_of("bert.encoder.layer.7.attention.self.query.weight") == "bert.encoder.layer.7"
    assert layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_of("encoder.block.0.layer.1.DenseReluDense.wi.weight") == "encoder.block.0"
    assert layer_of("bert.embeddings.word_embeddings.weight") is None
    names = [
        "emb.weight",
        "enc.layer.0.w",
        "enc.layer.0.b",
        "enc.layer.1.w",
        "norm.weight",
        "head.weight",
    ]
    assert layer_units(names) == [
        ["emb.weight", "enc.layer.0.w", "enc.layer.0.b"],
        ["enc.layer.1.w"],
    ]
