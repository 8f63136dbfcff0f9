"""The measured profile on the device (`ftpipe compile --profile measured --device cuda`),
with host swapping: a model whose weights do not fit the memory limit, timed a layer at a
time with only that layer's weights on the device: the blocks, the largest, the peak against
the limit, the loss, and the forward and backward seconds summed over the blocks."""

from __future__ import annotations

from ..registry import Check, Findings, part


@part("measured", "Measured profile with host swapping", cuda_s=75, cpu_s=45,
      needs=("compiler", "transformers"))  # fmt: skip
def measured(check: Check, found: Findings) -> None:
    from ftpipe_compiler.costs.profilers import costed_graph

    s = check.sizes
    _, _, traced, graph = costed_graph(
        s.profile_model, seq_len=s.profile_seq, micro_batch=1, granularity="layer",
        profile="measured", precision="fp32", device=check.device, repeats=2,
        memory_limit_gb=s.profile_memory_gb, cache=False,
    )  # fmt: skip
    m = graph.meta["measured"]
    weights = sum(t.numel() * t.element_size() for t in traced.program.state_dict.values())
    found.update(model=s.profile_model, seq_len=s.profile_seq, blocks=len(graph.nodes),
                 device=m["device"], seconds=m["seconds"], loss=m["loss"],
                 memory_limit_bytes=m["memory_limit_bytes"], largest_block=m["largest_block"],
                 peak_bytes=m["peak_bytes"], weights_bytes=weights,
                 peak_block=max(m["block_peak_bytes"], key=m["block_peak_bytes"].get,
                                default=None),
                 fwd_s=sum(n.fwd_s for n in graph.nodes),
                 bwd_s=sum(n.bwd_s for n in graph.nodes))  # fmt: skip
    found.expect(len(graph.nodes) > 1, "the profile has one block: nothing was swapped")
    if check.device == "cuda":
        limit = m["memory_limit_bytes"]
        found.expect(weights > limit, "the model fits the limit whole: no host swapping shown")
        found.expect(m["peak_bytes"] <= limit, f"a block peaked at {m['peak_bytes']} B, over "
                     f"the {limit} B limit")  # fmt: skip
