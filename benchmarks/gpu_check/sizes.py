"""How big each part's work is: the real sizes on a GPU, tiny ones on a CPU (the same code in
`make test`, in seconds, so that it cannot rot).

    sizes = SIZES["cuda"]      # or SIZES["cpu"]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SIZES", "Sizes"]


@dataclass(frozen=True)
class Sizes:
    # every schedule, several stages on one device, against the same run on the CPU
    schedule_model: str
    schedule_stages: int
    schedule_steps: int
    # the Llama-3.2-1B-shaped run: model, tokens per sequence, sequences per micro-batch and
    # per step, the precision; the steps timed (the first is the pipeline's fill)
    llama_model: str
    llama_seq: int
    llama_micro_batch: int
    llama_batch: int
    llama_dtype: str
    llama_steps: int
    # fused vs unfused LM-head loss: tokens, hidden width, vocabulary, dtype
    loss_tokens: tuple[int, ...]
    loss_width: int
    loss_vocab: int
    loss_dtype: str
    # matrix products (n x n x n), bytes copied, bytes between host and device, tiny ops timed
    gemm_n: int
    copy_bytes: int
    host_bytes: int
    op_launches: int
    # the measured profile: model, tokens, the memory a block may use (GB)
    profile_model: str
    profile_seq: int
    profile_memory_gb: float
    # generated stages against HF eager: timed training steps after a warm-up
    eager_repeats: int


SIZES = {
    "cuda": Sizes(
        schedule_model="llama-tiny",
        schedule_stages=4,
        schedule_steps=3,
        llama_model="llama-3.2-1b",
        llama_seq=2048,
        llama_micro_batch=2,
        llama_batch=8,
        llama_dtype="bf16",
        llama_steps=6,
        loss_tokens=(2048, 8192),
        loss_width=2048,
        loss_vocab=128256,
        loss_dtype="bfloat16",
        gemm_n=8192,
        copy_bytes=2 << 30,
        host_bytes=1 << 30,
        op_launches=2000,
        profile_model="llama-3.2-1b",
        profile_seq=512,
        profile_memory_gb=4.0,
        eager_repeats=11,
    ),
    "cpu": Sizes(
        schedule_model="llama-tiny",
        schedule_stages=4,
        schedule_steps=2,
        llama_model="llama-tiny",
        llama_seq=16,
        llama_micro_batch=2,
        llama_batch=8,
        llama_dtype="bf16",
        llama_steps=3,
        loss_tokens=(64, 256),
        loss_width=32,
        loss_vocab=512,
        loss_dtype="float32",
        gemm_n=128,
        copy_bytes=16 << 20,
        host_bytes=0,
        op_launches=200,
        profile_model="llama-tiny",
        profile_seq=16,
        profile_memory_gb=1.0,
        eager_repeats=2,
    ),
}
