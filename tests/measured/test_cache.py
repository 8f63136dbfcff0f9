"""The profile cache: a second call times nothing, --no-cache times again, keys are honest."""

from __future__ import annotations

import json

from ftpipe_compiler.costs.cache import load_profile, profile_dir, profile_key
from ftpipe_compiler.costs.measured import measured_costs


def _costs(graph):
    return [(n.fwd_s, n.bwd_s, n.recompute_s, n.act_bytes) for n in graph.nodes]


def test_second_call_is_a_hit_and_no_cache_profiles_again(
    t5_tiny_layer, timed_blocks, private_cache
):
    spec, _, traced, _ = t5_tiny_layer
    first = measured_costs(traced, spec, granularity="layer", repeats=1)
    n = len(first.nodes)
    assert len(timed_blocks) == n and first.meta["measured"]["cache"] == "miss"
    assert len(list(private_cache.glob("*.json"))) == 1
    second = measured_costs(traced, spec, granularity="layer", repeats=1)
    assert len(timed_blocks) == n  # nothing timed again
    assert second.meta["measured"]["cache"] == "hit" and _costs(second) == _costs(first)
    fresh = measured_costs(traced, spec, granularity="layer", repeats=1, cache=False)
    assert len(timed_blocks) == 2 * n and fresh.meta["measured"]["cache"] == "miss"
    # Other settings are other profiles.
    measured_costs(traced, spec, granularity="layer", repeats=2)
    measured_costs(traced, spec, granularity="op", repeats=1)
    assert len(list(private_cache.glob("*.json"))) == 3


def test_cache_dir_argument_beats_the_environment(t5_tiny_layer, tmp_path, private_cache):
    spec, _, traced, _ = t5_tiny_layer
    assert profile_dir() == private_cache
    measured_costs(traced, spec, granularity="layer", repeats=1, cache_dir=tmp_path / "mine")
    assert len(list((tmp_path / "mine").glob("*.json"))) == 1
    assert not private_cache.exists()


def test_key_follows_what_the_times_depend_on(t5_tiny_layer):
    spec, _, _, graph = t5_tiny_layer
    base = dict(granularity="layer", device="cpu (x86_64, 2 threads)", repeats=3, seed=0)
    key = profile_key(spec, graph, **base)
    assert key == profile_key(spec, graph, **base)
    for change in ({"repeats": 5}, {"device": "cpu (x86_64, 1 threads)"}, {"granularity": "op"}):
        assert profile_key(spec, graph, **{**base, **change}) != key
    other = type(spec)(**{**spec.__dict__, "config": {**spec.config, "d_ff": 128}})
    assert profile_key(other, graph, **base) != key


def test_a_damaged_entry_is_a_miss_and_is_rewritten(t5_tiny_layer, timed_blocks, private_cache):
    spec, _, traced, _ = t5_tiny_layer
    measured_costs(traced, spec, granularity="layer", repeats=1)
    (entry,) = private_cache.glob("*.json")
    entry.write_text(entry.read_text()[:100])
    again = measured_costs(traced, spec, granularity="layer", repeats=1)
    assert again.meta["measured"]["cache"] == "miss"
    assert json.loads(entry.read_text())["kind"] == "ftpipe-graph"
    assert load_profile(entry.stem, again) is not None
