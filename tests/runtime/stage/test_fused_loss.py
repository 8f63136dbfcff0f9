"""The LM head and its loss as one op: the unfused ops' loss and gradients, one logits-sized
tensor kept for backward instead of the unfused loss's two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ftpipe_runtime.engine.split_backward import backward_input, backward_weight
from ftpipe_runtime.stage import fused_loss
from ftpipe_runtime.stage.fused_loss import linear_cross_entropy
from torch.utils._python_dispatch import TorchDispatchMode

TOKENS, WIDTH, VOCAB = (2, 9), 16, 50


def _inputs(dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*TOKENS, WIDTH, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(VOCAB, WIDTH, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=g, dtype=dtype).requires_grad_() if bias else None
    t = torch.randint(0, VOCAB, TOKENS, generator=g)
    t[0, 3], t[1, :2] = -100, -100  # ignored tokens (padding, the last position)
    return x, w, b, t


def _unfused(x, w, b, t, dtype):
    return F.cross_entropy(F.linear(x, w, b).to(dtype).view(-1, VOCAB), t.view(-1))


def _grads(loss, tensors):
    return torch.autograd.grad(loss * 0.25, [u for u in tensors if u is not None])


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setitem(fused_loss.CHUNK_BYTES, "cpu", 4 * VOCAB * 4)  # 4 tokens a chunk: 5


@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_are_the_unfused_ones(small_chunks, bias):
    x, w, b, t = _inputs(torch.float32, bias)
    want = _unfused(x, w, b, t, torch.float32)
    got = linear_cross_entropy(x, w, b, t, -100, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, r in zip(_grads(got, (x, w, b)), _grads(want, (x, w, b))):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_bfloat16_products_with_a_float32_loss(small_chunks):
    """Mixed precision: the product in bf16, the loss over its logits upcast, as HF's."""
    x, w, b, t = _inputs(torch.bfloat16)
    want = _unfused(x, w, b, t, torch.float32)
    got = linear_cross_entropy(x, w, b, t, -100, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, r in zip(_grads(got, (x, w, b)), _grads(want, (x, w, b))):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-3)


def test_without_gradients_the_loss_alone(small_chunks):
    x, w, b, t = _inputs(torch.float32)
    with torch.no_grad():
        got = linear_cross_entropy(x, w, b, t, -100, torch.float32)
        want = _unfused(x, w, b, t, torch.float32)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_every_token_ignored_is_nan_as_torchs():
    x, w, b, t = _inputs(torch.float32)
    t.fill_(-100)
    assert torch.isnan(linear_cross_entropy(x, w, b, t, -100, None))
    assert torch.isnan(_unfused(x, w, b, t, torch.float32))


def test_on_meta_only_the_shape():
    x = torch.empty(*TOKENS, WIDTH, device="meta", dtype=torch.bfloat16)
    w = torch.empty(VOCAB, WIDTH, device="meta", dtype=torch.bfloat16)
    t = torch.empty(TOKENS, device="meta", dtype=torch.long)
    out = linear_cross_entropy(x, w, None, t, -100, torch.float32)
    assert out.device.type == "meta" and out.shape == () and out.dtype == torch.float32


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd keeps for backward."""
    kept = {}

    def pack(t):
        kept[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(kept.values())


def test_backward_keeps_no_more_than_the_unfused_loss():
    """Between forward and backward both keep the input, the weight and one logits-sized
    tensor (the fused op: the logits and a float per token; the unfused: their log-softmax);
    the saving is in what the backward makes: nothing that size (in place), the unfused two."""
    x, w, b, t = _inputs(torch.float32, bias=False)
    fused = _saved_bytes(lambda: linear_cross_entropy(x, w, None, t, -100, torch.float32))
    unfused = _saved_bytes(lambda: _unfused(x, w, None, t, torch.float32))
    tokens = x.numel() // WIDTH
    assert fused <= unfused + tokens * 4
    assert fused >= tokens * VOCAB * 4


def test_a_split_backward_input_then_weight_gradients(small_chunks):
    """Zero-bubble schedules ask for the input's gradient first, the weight's later, on one
    graph: each is the one a single backward gives."""
    x, w, b, t = _inputs(torch.float32)
    want = _grads(_unfused(x, w, b, t, torch.float32), (x, w, b))
    loss = linear_cross_entropy(x, w, b, t, -100, torch.float32) * 0.25
    (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    gw, gb = torch.autograd.grad(loss, [w, b])
    for g, r in zip((gx, gw, gb), want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


class Products(TorchDispatchMode):
    """The first operand's shape of every matrix product run inside."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_a_split_backward_runs_each_product_once():
    """B asks for the input's gradient, W for the weight's (as the runtime's split backward
    asks them): one product each, not both twice, and the gradients a backward gives."""
    x, w, _, t = _inputs(torch.float32, bias=False)
    loss = linear_cross_entropy(x, w, None, t, -100, torch.float32)
    tokens = x.numel() // WIDTH
    with Products() as b:
        later = backward_input([loss], [None], [x], [w])
    with Products() as wgrad:
        backward_weight(later)
    assert b.shapes == [(tokens, VOCAB)]  # d logits @ W
    assert wgrad.shapes == [(VOCAB, tokens)]  # d logitsᵀ @ x
    want = torch.autograd.grad(_unfused(x, w, None, t, torch.float32), (x, w))
    for g, r in zip((x.grad, w.grad), want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_off_a_cpu_the_product_is_torchs_own_and_a_split_backward_runs_it_once():
    """Off a CPU the product stays torch's recorded op, whose backward knows what each pass
    asks for (run here on a CPU through the same Function)."""
    x, w, _, t = _inputs(torch.float32, bias=False)
    x2 = x.reshape(-1, WIDTH)
    loss = fused_loss._LogitsLoss.apply(fused_loss._recorded(x2, w, None), t.reshape(-1), -100,
                                        torch.float32)  # fmt: skip
    with Products() as b:
        (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    with Products() as wgrad:
        (gw,) = torch.autograd.grad(loss, [w])
    assert b.shapes == [(x2.shape[0], VOCAB)] and wgrad.shapes == [(VOCAB, x2.shape[0])]
    want = torch.autograd.grad(_unfused(x, w, None, t, torch.float32), (x, w))
    for g, r in zip((gx, gw), want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_buffers_are_reused_once_their_graph_and_gradient_are_gone():
    """The logits' buffer of one micro-batch serves the next once its backward ran and its
    graph was dropped; the weight's gradient buffer stays busy while it is the `.grad`, and
    once idle an evaluation lets it go (`release_idle_gradients`)."""
    x, w, _, t = _inputs(torch.float32, bias=False)
    held = fused_loss._buffers.held
    logits = held.setdefault((x.numel() // WIDTH * VOCAB, torch.float32), [])
    first = linear_cross_entropy(x, w, None, t, -100, torch.float32)
    second = linear_cross_entropy(x, w, None, t, -100, torch.float32)
    count = len(logits)
    assert count >= 2  # both graphs alive: two buffers
    first.backward()
    second.backward()
    del first, second
    third = linear_cross_entropy(x, w, None, t, -100, torch.float32)
    assert len(logits) == count  # an idle one reused
    grads = fused_loss._gradients.held[(VOCAB * WIDTH, torch.float32)]
    assert any(g.data_ptr() == w.grad.data_ptr() for g in grads)  # .grad is one, kept busy
    before = w.grad.clone()
    third.backward()
    torch.testing.assert_close(w.grad, before * 1.5, rtol=1e-5, atol=1e-6)
    del third
    fused_loss.release_idle_gradients()
    assert [g.data_ptr() for g in grads] == [w.grad.data_ptr()]  # the busy one stays
    w.grad = None
    fused_loss.release_idle_gradients()
    assert grads == []


def test_a_weight_read_twice_has_its_gradients_summed_in_place():
    """Where the stage reads the weight elsewhere too (`Stage.reread`: T5's decoder embeds
    with its tied embedding), the executor has the head make the weight's gradient outside
    the pool (`pooled_weight_gradients(False)`), and autograd adds the embedding's into it in
    place. In a kept buffer, held by the pool too, their sum was made beside them: one more
    weight-sized tensor."""
    x, w, _, t = _inputs(torch.float32, bias=False)
    ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(3))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _unfused(x2 + F.embedding(ids, w2), w2, None, t, torch.float32).backward()
    for pooled in (False, True):
        w.grad = None
        summed, head = [], []
        hook = w.register_hook(lambda g, summed=summed: summed.append(g.data_ptr()))
        with fused_loss.pooled_weight_gradients(pooled):
            loss = linear_cross_entropy(x + F.embedding(ids, w), w, None, t, -100, torch.float32)
        # The op's own backward node: its second output is the weight's gradient.
        loss.grad_fn.register_hook(lambda grads, _, head=head: head.append(grads[1].data_ptr()))
        loss.backward()
        hook.remove()
        assert (summed == head) is not pooled  # the head's gradient took the embedding's in
        torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_a_backward_asking_for_one_side_runs_one_product():
    """Asked for the input's gradient alone (the profiler's B-alone timing, `costs.blocks`) or
    the weight's alone, the op runs that side's product only, as torch's own would."""
    x, w, _, t = _inputs(torch.float32, bias=False)
    for wanted, other in ((x, w), (w, x)):
        loss = linear_cross_entropy(x, w, None, t, -100, torch.float32)
        with Products() as one:
            torch.autograd.grad(loss, [wanted], retain_graph=True)
        with Products() as both:
            torch.autograd.grad(loss, [wanted, other])
        assert len(one.shapes) == 1 and len(both.shapes) == 2


def test_a_gpu_reads_the_logits_in_few_big_chunks():
    """8,192 tokens of a 128k vocabulary in fp32 (4 GB of logits): 512 chunks of 8 MB on a
    CPU (the cache-sized ones), 16 of 256 MB on a GPU (each chunk is ~10 kernel launches)."""
    tokens, vocab = 8192, 128256

    def count(device):
        return len(list(fused_loss._chunks(tokens, vocab, 4, device)))

    assert count("cpu") == -(-tokens // (fused_loss.CHUNK_BYTES["cpu"] // (vocab * 4)))
    assert count(torch.device("cuda", 1)) == -(-tokens // ((256 << 20) // (vocab * 4)))
    assert count("cpu") >= 512 and count("cuda") <= 16
    assert fused_loss.chunk_bytes("cuda:0") == 256 << 20


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_loss_and_gradients_are_the_unfused_ones(dtype):
    """The CUDA path (torch's own product, the loss in 256 MB chunks): several chunks of a
    wide vocabulary, against the unfused ops on the same GPU with TF32 off."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        _check_on_gpu(dtype)
    finally:
        torch.set_float32_matmul_precision(before)


def _check_on_gpu(dtype):
    g = torch.Generator().manual_seed(0)
    tokens, width, vocab = (4, 1024), 256, 32768  # 4,096 x 32k fp32 logits: 512 MB, 2 chunks
    x = torch.randn(*tokens, width, generator=g).to("cuda", dtype).requires_grad_()
    w = (torch.randn(vocab, width, generator=g) * 0.05).to("cuda", dtype).requires_grad_()
    t = torch.randint(0, vocab, tokens, generator=g).cuda()
    t[0, :7] = -100
    got = linear_cross_entropy(x, w, None, t, -100, torch.float32)
    want = F.cross_entropy(F.linear(x, w).float().view(-1, vocab), t.view(-1))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w))):
        torch.testing.assert_close(a, b, **tol)
