import pytest
import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from ftpipe_compiler.costs.analytic import analytic_costs, count_flops
from ftpipe_compiler.costs.hardware import Hardware, get_hardware
from ftpipe_compiler.graph.trace import trace_model
from ftpipe_compiler.model.tasks import resolve_task
from ftpipe_compiler.model.zoo import resolve_model

HW = Hardware(
    "test",
    memory_bytes=2**30,
    peak_flops=1e12,
    memory_bandwidth=1e11,
    link_bandwidth=1e9,
    efficiency=1.0,
)


@pytest.fixture(scope="module")
def linear_graph():
    spec = resolve_model("zoo_fixtures:linear_model")
    traced = trace_model(spec, resolve_task(spec, None), 8)
    return analytic_costs(traced, HW)


def test_linear_flops_are_2mnk(linear_graph):
    (lin,) = [n for n in linear_graph.nodes if n.op == "aten.linear.default"]
    m, k, n = 8, 64, 48
    assert lin.flops == 2 * m * n * k


def test_roofline_time_and_backward_factor(linear_graph):
    (lin,) = [n for n in linear_graph.nodes if n.op == "aten.linear.default"]
    moved = (8 * 64 + 64 * 48 + 8 * 48) * 4  # read input and weight, write output
    assert lin.bytes_moved == moved
    assert lin.fwd_s == pytest.approx(max(lin.flops / 1e12, moved / 1e11))
    assert lin.bwd_s == pytest.approx(2 * lin.fwd_s)
    assert lin.recompute_s == lin.fwd_s


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_experts_cost_what_the_tokens_routed_to_them_compute(tmp_path, precision):
    """A mixture of experts multiplies each token by its top-k experts' matrices (grouped
    products: transformers' fallback op in fp32, torch's `_grouped_mm` in bf16), which
    torch's FLOP counter does not know: counted, they are 2 x tokens x k x the expert MLP's
    weights per layer, what the same tokens through k dense MLPs would cost."""
    transformers = pytest.importorskip("transformers")
    hidden, inner, k, tokens, layers = 32, 64, 2, 16, 2
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=inner, num_local_experts=4,
                                        num_experts_per_tok=k, max_position_embeddings=64)  # fmt: skip
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    task = resolve_task(spec, None, seq_len=tokens)
    graph = analytic_costs(trace_model(spec, task, 1, precision=precision), HW)
    grouped = [n for n in graph.nodes if "grouped_mm" in n.op]
    assert len(grouped) == 2 * layers  # gate and up together, then down
    per_layer = 2 * tokens * k * (hidden * 2 * inner + inner * hidden)
    assert sum(n.flops for n in grouped) == layers * per_layer


def test_views_cost_nothing(tiny_t5_costed):
    views = [n for n in tiny_t5_costed.nodes if n.op in ("aten.view.default", "aten.transpose.int")]
    assert views and all(n.fwd_s == 0 and n.act_bytes == 0 for n in views)


@pytest.mark.slow
def test_t5_3b_encoder_block_is_about_6x_a_decoder_block():
    # The imbalance Mixed-pipe exists for (512 encoder vs 4 decoder tokens): an encoder
    # block does ~6x a decoder block's compute with fewer parameters (50.3 M vs 67.1 M).
    spec = resolve_model("t5-3b")
    traced = trace_model(spec, resolve_task(spec, "rte"), 4)
    graph = analytic_costs(traced, get_hardware("rtx2080ti"), "layer")
    enc, dec = (
        next(n for n in graph.nodes if n.scope == s) for s in ("encoder.block.5", "decoder.block.5")
    )
    assert 5 < enc.flops / dec.flops < 8
    params = lambda n: sum(graph.param[p].bytes for p in n.params) // 4  # noqa: E731
    d, inner, ff = 1024, 32 * 128, 16384
    attention, mlp = 4 * d * inner, 2 * d * ff
    assert params(enc) == attention + mlp + 2 * d  # + two layer norms
    assert params(dec) == 2 * attention + mlp + 3 * d  # + cross-attention


def test_cpu_costs_16_bit_math_at_the_rate_measured_on_it():
    """configs/hardware/cpu.json describes this machine, whose CPU has no bf16 instructions:
    a bf16 matmul ran tens of times slower than fp32 (python -m benchmarks.calibrate --only
    matmul, dated in its sources), so a bf16 op costs that much more than the fp32 one,
    not the fp32 rate a plan was costed at before."""
    import re

    from ftpipe_compiler.resources import load_config

    hw = get_hardware("cpu")
    (note,) = [s for s in load_config("hardware", "cpu")["sources"] if "16-bit rates" in s]
    assert re.search(r"on \d{4}-\d\d-\d\d", note) and "flags: none" in note
    flops = 2 * 1024**3  # compute-bound: the kernel overhead is noise
    fp32 = hw.op_time(flops, 0, "float32")
    for dtype in ("bfloat16", "float16"):
        slower = float(re.search(rf"\b{dtype} (\d+)x", note)[1])
        assert slower > 10
        assert hw.op_time(flops, 0, dtype) / fp32 == pytest.approx(slower, rel=0.02)


@pytest.mark.parametrize("fixture", ["tiny_t5", "tiny_gpt2", "tiny_bert"])
def test_flops_counted_once_per_shape_are_those_of_running_the_program(request, fixture):
    """Each distinct op and input shapes run once: the FLOPs of every node are those of
    running the whole program on meta tensors under the counter, node by node."""
    traced = request.getfixturevalue(fixture)[3]
    program, counter, want = traced.program, FlopCounterMode(display=False), {}

    class Counting(fx.Interpreter):
        def run_node(self, n):
            before = counter.get_total_flops()
            out = super().run_node(n)
            if n.op == "call_function":
                want[n.name] = float(counter.get_total_flops() - before)
            return out

        def call_function(self, target, args, kwargs):  # traced on the CPU: devices baked in
            meta = torch.device("meta")
            args = tuple(meta if isinstance(a, torch.device) else a for a in args)
            kwargs = {k: meta if isinstance(v, torch.device) else v for k, v in kwargs.items()}
            return super().call_function(target, args, kwargs)

    args = [
        torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype, device="meta")
        for n in program.graph.nodes
        if n.op == "placeholder"
    ]
    with counter, torch.no_grad():
        Counting(program.graph_module).run(*args)
    assert count_flops(traced) == want
    assert sum(want.values()) > 0
