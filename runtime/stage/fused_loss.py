"""The LM head and its cross-entropy as one op that holds one logits-sized tensor, not four.

    loss = torch.ops.ftpipe.linear_cross_entropy(hidden, weight, bias, labels, -100, torch.float32)
    # = F.cross_entropy(F.linear(hidden, weight, bias).to(torch.float32).flatten(0, -2),
    #                   labels.flatten(), ignore_index=-100)

An LM head's logits are tokens x vocabulary: 51 MB for a GPT-2 micro-batch of 256 tokens, 4 GB
for 8,192 tokens of Llama 3's 128k vocabulary, and the unfused loss makes four such tensors per
micro-batch (the logits, their log-softmax kept for backward, the gradient of each). This op
makes one: the logits, in one product (a CPU core runs chunked products well below a whole
one's speed), read by the loss a chunk at a time (the log-softmax of a chunk only) and,
with gradients wanted, kept; the backward overwrites them in place, chunk by chunk, with
their gradient (their softmax, computed again, minus the one-hot target, over the counted
tokens) and computes from it the input's and the weight's gradients, each only where
the running backward wants it (a split backward's B and W each get the one they ask for).
Forward and backward cost what the unfused ones cost, less their passes over the big
tensors (in bf16 about as many: torch upcasts a bf16 chunk by a copy; on an H200 the fused
loss took 1.24x the unfused one's time, GPU_CHECK.md), and split the same way (a profile's
forward, timed without gradients, stays the forward a run times). The compiler puts it in place of linear -> [to] -> view ->
cross_entropy_loss in the traced graph (`ftpipe_compiler.graph.fuse`), so a profile times
what the run runs.

A chunk's size depends on the device (`CHUNK_BYTES`): on a CPU 8 MB, its log-softmax (and in
the backward its softmax) written into one kept chunk-sized buffer; on a GPU 256 MB, as each
chunk costs ~10 kernel launches and a GPU streams 256 MB in well under a millisecond: 8,192
tokens of a 128k vocabulary in fp32 (4 GB of logits) are 16 chunks, not 512, for one 256 MB
temporary at a time.

On a CPU the logits, the weight's gradient (`_weight_gradient`) and a chunk's (log-)softmax
live in buffers kept from one micro-batch to the next (`_Buffers`): torch's CPU allocator
maps each block above 32 MB afresh, and zeroing fresh pages was a quarter of a 2-rank run's
CPU time on the benchmark model (`perf`, clear_page_erms); with the buffers the head stage's
actions spend ~1 ms in the kernel (were 20-50 ms). A chunk's temporary came from glibc's
heap, which a run keeps whole between optimizer steps (`job.cpu_allocator.keep_heap`): the
forward's and the backward's, freed among smaller blocks, were not always reused, so the
heap grew within a step: a 2-rank
PipeDream-2BW loss stage, at its peak (the step's last backward, the next weight version
in), held 12-27 MB of free heap beside its tensors, by chance of the layout. Off a CPU
(`_LogitsLoss`) the product is torch's own recorded op: a caching allocator reuses blocks
already.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = [
    "CHUNK_BYTES",
    "chunk_bytes",
    "linear_cross_entropy",
    "pooled_weight_gradients",
    "register",
    "release_idle_gradients",
]

# Bytes of logits the loss reads at a time, by device type; others take the GPU's.
CHUNK_BYTES = {
    "cpu": 8 << 20,  # 4 huge pages (job/cpu_allocator): few faults for a fresh chunk
    "cuda": 256 << 20,  # few launches; one bounded temporary (a chunk's log-softmax)
}

_SCHEMA = (
    "linear_cross_entropy(Tensor input, Tensor weight, Tensor? bias, Tensor target, "
    "int ignore_index=-100, ScalarType? logits_dtype=None) -> Tensor"
)


def chunk_bytes(device) -> int:
    """Bytes of logits read at a time on `device` (a torch.device or its name)."""
    kind = torch.device(device).type
    return CHUNK_BYTES.get(kind, CHUNK_BYTES["cuda"])


def _chunks(tokens: int, vocab: int, itemsize: int, device):
    rows = max(1, chunk_bytes(device) // max(1, vocab * itemsize))
    return ((i, min(i + rows, tokens)) for i in range(0, tokens, rows))


class _Buffers:
    """Logits- and weight-sized CPU buffers kept for the next micro-batch. torch's CPU
    allocator hands large blocks back to the OS when freed (above 2 MB: job/cpu_allocator),
    and each new one costs the kernel a page fault per page (on a VM whose host takes freed
    memory back, 20-60 ms per 51 MB). A buffer is free again when nothing but this pool
    holds its storage (`_idle`): its autograd graph is gone, the gradient accumulated from it
    no longer a parameter's `.grad`. So the pool holds as many per shape as were alive at
    once (a GPipe stage: one per micro-batch in flight, what the step's peak held anyway).
    Other devices allocate as usual: their caching allocators already reuse blocks."""

    def __init__(self) -> None:
        self.held: dict[tuple, list[torch.Tensor]] = {}

    def take(self, rows: int, cols: int, dtype, device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(rows, cols, dtype=dtype, device=device)
        held = self.held.setdefault((rows * cols, dtype), [])
        for anchor in held:
            if _idle(anchor):
                return anchor.view(rows, cols)
        held.append(torch.empty(rows * cols, dtype=dtype))
        return held[-1].view(rows, cols)

    def release_idle(self) -> None:
        """Drop the buffers nothing but the pool holds (the next `take` maps one afresh)."""
        for held in self.held.values():
            held[:] = [a for a in held if not _idle(a)]


def _idle(anchor: torch.Tensor) -> bool:
    """Does nothing but the pool hold this buffer's storage? The anchor and the storage
    object asked for: 2 references when idle."""
    return torch._C._storage_Use_Count(anchor.untyped_storage()._cdata) == 2


_buffers = _Buffers()


def _chunk_buffer(z, dtype):
    """Where a chunk of `z`'s (log-)softmax is written: on a CPU a kept buffer of the largest
    chunk's rows (each chunk a view of its first rows); elsewhere None (the op allocates)."""
    if z.device.type != "cpu":
        return None
    rows = next(_chunks(z.shape[0], z.shape[1], dtype.itemsize, z.device), (0, 0))[1]
    return _buffers.take(rows, z.shape[1], dtype, z.device)


def _rows(buf, n: int):
    return None if buf is None else buf[:n]


def _logits(x2, weight, bias):
    """All the tokens' logits in one product (chunked products run well below a whole one's
    speed on a CPU core), in the input's dtype, as the unfused head computes them, into a
    kept buffer."""
    z = _buffers.take(x2.shape[0], weight.shape[0], x2.dtype, x2.device)
    if bias is None:
        return torch.mm(x2, weight.T, out=z)
    return torch.addmm(bias, x2, weight.T, out=z)


def _cross_entropy(z, t, ignore_index, logits_dtype):
    """The mean loss over the counted tokens of logits `z`, read a chunk at a time (upcast
    there if the loss asks for another dtype than the product's)."""
    dtype = logits_dtype or z.dtype
    total = torch.zeros((), dtype=dtype, device=z.device)
    buf = _chunk_buffer(z, dtype)
    for i, j in _chunks(z.shape[0], z.shape[1], dtype.itemsize, z.device):
        zc = z[i:j]
        # The upcast rides in the softmax kernel only for fp16 on a GPU; torch converts
        # bf16 (and anything on a CPU) to a float copy of the chunk first (aten's
        # SoftMax.cpp), one more pass over it.
        logp = torch.log_softmax(zc, dim=-1, dtype=dtype, out=_rows(buf, j - i))
        tc = t[i:j]
        keep = tc != ignore_index
        total = total - (logp.gather(1, tc.clamp(min=0)[:, None])[:, 0] * keep).sum()
    return total / (t != ignore_index).sum()  # a mean, as torch's (NaN if none counted)


def _loss_only(x, weight, bias, target, ignore_index, logits_dtype):
    x2, t = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    return _cross_entropy(_logits(x2, weight, bias), t, ignore_index, logits_dtype)


def _recorded(x2, weight, bias):
    """The product as torch's own recorded op (its backward computes each side only where a
    pass asks for it), in memory of its own."""
    return torch.mm(x2, weight.T) if bias is None else torch.addmm(bias, x2, weight.T)


def _into_gradient(ctx, upstream) -> tuple[torch.Tensor, list]:
    """The kept logits turned in place, a chunk at a time, into their gradient (the softmax
    minus the one-hot target, over the counted tokens, times the upstream gradient), once:
    a split backward (zero-bubble B, then W on the same graph) asks twice. Scaled afresh for
    a second call with another upstream gradient. Returns it and the other tensors saved
    (unpacked once: unpacking checks them all, the logits changed since)."""
    if ctx.done is None:
        z, t, *rest = ctx.saved_tensors
        dtype = ctx.dtype
        keep = t != ctx.ignore_index
        scale = upstream.to(dtype) / keep.sum().to(dtype)
        buf = _chunk_buffer(z, dtype)
        for i, j in _chunks(z.shape[0], z.shape[1], dtype.itemsize, z.device):
            # Two passes over a chunk (on a GPU the loss's time is memory traffic), three
            # in bf16 (its upcast is a copy, as in the forward): the softmax; then scaled
            # into the logits' own memory, cast back to their dtype on the way, as the
            # unfused `to`'s backward.
            p = torch.softmax(z[i:j], dim=-1, dtype=dtype, out=_rows(buf, j - i))
            p[torch.arange(j - i, device=z.device), t[i:j].clamp(min=0)] -= 1.0
            torch.mul(p, (keep[i:j] * scale)[:, None], out=z[i:j])
        ctx.done = z, upstream, rest
    z, first, rest = ctx.done
    same = upstream is first or bool(torch.equal(upstream, first))
    return (z if same else z * (upstream / first).to(z.dtype)), rest


def _keep_loss(ctx, z, t, ignore_index, logits_dtype, *more):
    loss = _cross_entropy(z, t, ignore_index, logits_dtype)
    ctx.save_for_backward(z, t, *more)
    ctx.ignore_index, ctx.dtype, ctx.done = ignore_index, logits_dtype or z.dtype, None
    return loss


class _LogitsLoss(torch.autograd.Function):
    """The cross-entropy of logits it owns (off a CPU): forward keeps them (the unfused loss
    keeps their log-softmax, as big); backward turns them into their gradient and hands that
    to the product's own recorded backward."""

    @staticmethod
    def forward(ctx, z, t, ignore_index, logits_dtype):
        return _keep_loss(ctx, z, t, ignore_index, logits_dtype)

    @staticmethod
    def backward(ctx, upstream):
        return _into_gradient(ctx, upstream)[0], None, None, None


def _wanted(ctx, i: int) -> bool:
    """Does the running backward want the gradient of the Function's `i`-th input? What a
    recorded op's backward asks the engine, asked from Python: the engine knows for every
    node, and for a leaf that `autograd.grad` captures (one it was asked for) it raises."""
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # "a leaf node ... autograd.grad()": a leaf it captures, so wanted
        return True


class _HeadLoss(torch.autograd.Function):
    """Product and cross-entropy in one node (on a CPU), its big tensors in kept buffers: the
    logits, and the weight's gradient (`_Buffers`). Each side's product runs only when the
    running backward wants it (`_wanted`): a split backward's B computes the input's, W the
    weight's."""

    @staticmethod
    def forward(ctx, x2, weight, bias, t, ignore_index, logits_dtype):
        z = _logits(x2, weight, bias)
        ctx.pooled = _pooling[0]
        return _keep_loss(ctx, z, t, ignore_index, logits_dtype, x2, weight)

    @staticmethod
    def backward(ctx, upstream):
        g, (x2, weight) = _into_gradient(ctx, upstream)
        gx = gw = gb = None
        if ctx.needs_input_grad[0] and _wanted(ctx, 0):
            gx = torch.mm(g, weight.to(g.dtype))
        if ctx.needs_input_grad[1] and _wanted(ctx, 1):
            gw = _weight_gradient(g, x2, ctx.pooled)
        if ctx.needs_input_grad[2] and _wanted(ctx, 2):
            gb = g.sum(0)
        return gx, gw, gb, None, None, None


def _weight_gradient(g, x2, pooled: bool) -> torch.Tensor:
    """g.T @ x2, on a CPU into a kept buffer (`_gradients`) unless the stage reads the weight
    elsewhere too (`pooled_weight_gradients`)."""
    if not pooled:
        return torch.mm(g.T, x2.to(g.dtype))
    gw = _gradients.take(g.shape[1], x2.shape[1], g.dtype, g.device)
    return torch.mm(g.T, x2.to(g.dtype), out=gw)


# The weight's gradient in a kept buffer: a weight-sized block mapped afresh each backward
# cost the head stage of the runtime benchmark's even split 32 ms of kernel time per
# backward (zeroing its pages), 1 ms pooled. Apart from the logits' pool, so that an
# evaluation can let its idle buffers go (`release_idle_gradients`).
_gradients = _Buffers()
_pooling = [True]


@contextlib.contextmanager
def pooled_weight_gradients(pooled: bool):
    """Around a stage's forward (the executor's): may its LM head keep the weight's gradient
    in a kept buffer? Not where the stage reads that weight twice (`Stage.reread`: T5's
    decoder embeds and predicts with its tied embedding): autograd adds two gradients of one
    tensor in place only if nothing else holds their memory, and the pool does, so their sum
    was made beside them, one weight-sized tensor more at the stage's peak (a 2-rank T5's
    rank 1 at 1.29 x its plan, 1.08 without)."""
    before, _pooling[0] = _pooling[0], pooled
    try:
        yield
    finally:
        _pooling[0] = before


def release_idle_gradients() -> None:
    """Let the kept weight-gradient buffers that nothing uses go (the executor, before an
    evaluation: idle, they would sit beside its copy of the weights and raise the rank's
    peak; the next backward maps one afresh)."""
    _gradients.release_idle()


def _meta(x, weight, bias, target, ignore_index=-100, logits_dtype=None):
    dtype = logits_dtype or torch.promote_types(x.dtype, weight.dtype)
    return x.new_empty((), dtype=dtype)


def _autograd(x, weight, bias, target, ignore_index=-100, logits_dtype=None):
    tensors = (x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        x2, t = x.reshape(-1, x.shape[-1]), target.reshape(-1)
        if x.device.type == "cpu":
            return _HeadLoss.apply(x2, weight, bias, t, ignore_index, logits_dtype)
        z = _recorded(x2, weight, bias)  # its backward is the unfused linear's
        return _LogitsLoss.apply(z, t, ignore_index, logits_dtype)
    with torch._C._AutoDispatchBelowAutograd():
        return _loss_only(x, weight, bias, target, ignore_index, logits_dtype)


_libs: list[torch.library.Library] = []  # kept: the definitions live as long as the Library


def register() -> None:
    """Define `torch.ops.ftpipe.linear_cross_entropy` in this process, once (importing this
    module does not: the stage base class, the compiler's fusion and `linear_cross_entropy`
    call this first). A second copy of this module (a test that drops the package from
    sys.modules) finds the op there already."""
    if torch._C._dispatch_has_kernel("ftpipe::linear_cross_entropy"):
        return
    lib = torch.library.Library("ftpipe", "FRAGMENT")
    lib.define(_SCHEMA)
    for key, kernel in (
        ("CompositeExplicitAutograd", _loss_only),
        ("Meta", _meta),
        ("Autograd", _autograd),
    ):
        lib.impl("linear_cross_entropy", kernel, key)
    _libs.append(lib)


def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, logits_dtype=None):
    """The op, called from Python."""
    register()
    return torch.ops.ftpipe.linear_cross_entropy(
        x, weight, bias, target, ignore_index, logits_dtype
    )
