"""Mixed precision's gradient sums (`ftpipe_runtime.train.precision`)."""

from __future__ import annotations

import torch
from ftpipe_runtime.train.precision import CAST_CHUNK, add_grad, add_into
from torch.profiler import ProfilerActivity, profile


def _largest_allocation(fn) -> int:
    """The largest CPU allocation `fn` makes, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def test_a_16_bit_gradient_is_added_into_its_fp32_sum_without_a_copy_of_it():
    """ATen on the CPU copies a bf16 operand into fp32 before adding it (4 bytes an element
    of the whole gradient); `add_into` adds a chunk at a time: the same sums, bit for bit,
    with at most a chunk's fp32 copy alive."""
    torch.manual_seed(0)
    numel = 10 * CAST_CHUNK + 123  # a ragged last chunk
    total = torch.randn(numel)
    g = torch.randn(numel).to(torch.bfloat16)
    want = total + g.float()
    plain = total.clone()
    assert _largest_allocation(lambda: plain.add_(g)) >= 4 * numel  # what it avoids
    assert _largest_allocation(lambda: add_into(total, g)) <= 4 * CAST_CHUNK
    assert torch.equal(total, want) and torch.equal(plain, want)


def test_same_dtypes_and_strided_gradients_are_added_whole():
    total, g = torch.zeros(4, 6), torch.arange(24.0).view(6, 4).t()  # not contiguous
    add_into(total, g.to(torch.bfloat16))
    add_into(total, g)
    assert torch.equal(total, 2 * g)


def test_the_first_gradient_is_copied_the_next_added():
    master = torch.zeros(3, requires_grad=True)
    g = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    add_grad(master, g)
    assert master.grad.dtype == torch.float32 and master.grad.data_ptr() != g.data_ptr()
    add_grad(master, g)
    assert torch.equal(master.grad, torch.tensor([2.0, 4.0, 6.0]))
