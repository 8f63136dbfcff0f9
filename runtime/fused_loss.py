"""The LM head and its cross-entropy as one op that holds one logits-sized tensor, not four.

    loss = torch.ops.ftpipe.linear_cross_entropy(hidden, weight, bias, labels, -100, torch.float32)
    # = F.cross_entropy(F.linear(hidden, weight, bias).to(torch.float32).flatten(0, -2),
    #                   labels.flatten(), ignore_index=-100)

An LM head's logits are tokens x vocabulary: 51 MB for a GPT-2 micro-batch of 256 tokens, 4 GB
for 8,192 tokens of Llama 3's 128k vocabulary, and the unfused loss makes four such tensors per
micro-batch (the logits, their log-softmax kept for backward, the gradient of each). This op
makes one: the logits, in one product (a CPU core runs chunked products well below a whole
one's speed), read by the loss `CHUNK_BYTES` at a time (the log-softmax of a chunk only) and,
with gradients wanted, kept with each token's log-sum-exp; the backward overwrites them in
place, chunk by chunk, with their gradient (the softmax minus the one-hot target, over the
counted tokens) and hands it to the product's own backward (the product is an ordinary
recorded op: a split backward's B and W each get the one gradient they ask for). Forward
and backward cost what the unfused ones cost, less their passes over the big tensors, and
split the same way (a profile's forward, timed without gradients, stays the forward a run
times). The compiler puts it in place of linear -> [to] -> view -> cross_entropy_loss in the
traced graph (`ftpipe_compiler.graph.fuse`), so a profile times what the run runs.

On a CPU this also spares the kernel from mapping and zeroing three of the four big tensors
afresh for every micro-batch (glibc maps each block above 32 MB anew, and zeroing fresh pages
was a quarter of a 2-rank run's CPU time on the benchmark model: `perf`, clear_page_erms).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_BYTES", "linear_cross_entropy"]

CHUNK_BYTES = 8 << 20  # logits of one chunk: below glibc's largest mmap threshold (32 MB)

_SCHEMA = (
    "linear_cross_entropy(Tensor input, Tensor weight, Tensor? bias, Tensor target, "
    "int ignore_index=-100, ScalarType? logits_dtype=None) -> Tensor"
)


def _chunks(tokens: int, vocab: int, itemsize: int):
    rows = max(1, CHUNK_BYTES // max(1, vocab * itemsize))
    return ((i, min(i + rows, tokens)) for i in range(0, tokens, rows))


def _logits(x2, weight, bias):
    """All the tokens' logits in one product (chunked products run well below a whole one's
    speed on a CPU core), in the input's dtype, as the unfused head computes them."""
    return torch.mm(x2, weight.T) if bias is None else torch.addmm(bias, x2, weight.T)


def _cross_entropy(z, t, ignore_index, logits_dtype, lse=None):
    """The mean loss over the counted tokens of logits `z`, read a chunk at a time (upcast
    there if the loss asks for another dtype than the product's); with `lse` (a tensor of
    tokens), each token's log-sum-exp written into it."""
    dtype = logits_dtype or z.dtype
    total = torch.zeros((), dtype=dtype, device=z.device)
    for i, j in _chunks(z.shape[0], z.shape[1], dtype.itemsize):
        zc = z[i:j].to(dtype)
        logp = torch.log_softmax(zc, dim=-1)  # one chunk: malloc's heap, not fresh pages
        tc = t[i:j]
        keep = tc != ignore_index
        total = total - (logp.gather(1, tc.clamp(min=0)[:, None])[:, 0] * keep).sum()
        if lse is not None:
            lse[i:j] = zc[:, 0] - logp[:, 0]
    return total / (t != ignore_index).sum()  # a mean, as torch's (NaN if none counted)


def _loss_only(x, weight, bias, target, ignore_index, logits_dtype):
    x2, t = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    return _cross_entropy(_logits(x2, weight, bias), t, ignore_index, logits_dtype)


class _LogitsLoss(torch.autograd.Function):
    """The cross-entropy of logits it owns: forward keeps them and each token's log-sum-exp
    (the unfused loss keeps their log-softmax, as big); backward turns them in place, a chunk
    at a time, into their gradient (the softmax minus the one-hot target, over the counted
    tokens, times the upstream gradient) and hands that to the product's own backward, which
    computes the input's and the weight's gradients only where they are asked for."""

    @staticmethod
    def forward(ctx, z, t, ignore_index, logits_dtype):
        lse = torch.empty(t.shape[0], dtype=logits_dtype or z.dtype, device=z.device)
        loss = _cross_entropy(z, t, ignore_index, logits_dtype, lse)
        ctx.save_for_backward(z, lse, t)
        ctx.ignore_index, ctx.done = ignore_index, None
        return loss

    @staticmethod
    def backward(ctx, upstream):
        # A split backward (zero-bubble B, then W on the same graph) calls this twice: the
        # logits become their gradient once.
        if ctx.done is None:
            z, lse, t = ctx.saved_tensors
            keep = t != ctx.ignore_index
            scale = upstream.to(lse.dtype) / keep.sum().to(lse.dtype)
            for i, j in _chunks(z.shape[0], z.shape[1], lse.dtype.itemsize):
                zc = z[i:j].to(lse.dtype)  # the same memory unless the loss read them upcast
                zc.sub_(lse[i:j, None]).exp_()  # the softmax
                zc[torch.arange(j - i, device=z.device), t[i:j].clamp(min=0)] -= 1.0
                zc.mul_((keep[i:j] * scale)[:, None])
                if zc.data_ptr() != z[i:j].data_ptr():
                    z[i:j] = zc  # back to the product's dtype, as the unfused `to` backward
            ctx.done = z, upstream
        z, first = ctx.done
        same = upstream is first or bool(torch.equal(upstream, first))
        return (z if same else z * (upstream / first).to(z.dtype)), None, None, None


def _meta(x, weight, bias, target, ignore_index=-100, logits_dtype=None):
    dtype = logits_dtype or torch.promote_types(x.dtype, weight.dtype)
    return x.new_empty((), dtype=dtype)


def _autograd(x, weight, bias, target, ignore_index=-100, logits_dtype=None):
    tensors = (x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        x2 = x.reshape(-1, x.shape[-1])
        z = _logits(x2, weight, bias)  # recorded: its backward is the unfused linear's
        return _LogitsLoss.apply(z, target.reshape(-1), ignore_index, logits_dtype)
    with torch._C._AutoDispatchBelowAutograd():
        return _loss_only(x, weight, bias, target, ignore_index, logits_dtype)


def _register() -> torch.library.Library | None:
    """Define the op once per process: a second import of this module (a test that drops the
    package from sys.modules) finds it there already."""
    if torch._C._dispatch_has_kernel("ftpipe::linear_cross_entropy"):
        return None
    lib = torch.library.Library("ftpipe", "FRAGMENT")
    lib.define(_SCHEMA)
    for key, kernel in (
        ("CompositeExplicitAutograd", _loss_only),
        ("Meta", _meta),
        ("Autograd", _autograd),
    ):
        lib.impl("linear_cross_entropy", kernel, key)
    return lib


_lib = _register()  # kept: the definitions live as long as the Library object


def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, logits_dtype=None):
    """The op, called from Python."""
    return torch.ops.ftpipe.linear_cross_entropy(
        x, weight, bias, target, ignore_index, logits_dtype
    )
