"""The memory promise on an encoder-decoder at real size, outside `make bench` (about 2.5
minutes a case on 2 cores; the section's Qwen2.5-0.5B shape takes its time budget).

    python -m benchmarks.memory.t5_large                 # bf16: ftpipe, gpipe
    python -m benchmarks.memory.t5_large fp32 ftpipe,2bw

A T5-large shape (738 M parameters, its 32,128 x 1,024 embedding tied: the decoder's stage
embeds and predicts with it, `Stage.reread`), random weights written in bf16 by
`save_pretrained`, compiled for 2 CPU ranks (even layers: the encoder on rank 0), 128 source
and 32 target tokens, 2 micro-batches of 1; 4 steps with an evaluation after the 3rd. Prints
each rank's measured peak against `gpu_memory` of the plan under that schedule (as the
section does) and the losses.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.harness.launch import ROOT, compile_plan, run_package
from ftpipe_compiler.costs.gpu_memory import gpu_memory
from ftpipe_compiler.plan import Plan

WORK = ROOT / "out" / "bench" / "memory-t5"
SHAPE = {"vocab_size": 32_128, "d_model": 1_024, "d_kv": 64, "d_ff": 4_096, "num_layers": 24,
         "num_decoder_layers": 24, "num_heads": 16}  # fmt: skip
SEQ, TARGET, MICRO_BATCHES, EVAL_SAMPLES = 128, 32, 2, 4


def main(dtype: str = "bf16", schedules: str = "ftpipe,gpipe") -> None:
    import torch

    folder = WORK / "model"
    if not (folder / "config.json").exists():
        from transformers import T5Config, T5ForConditionalGeneration

        torch.manual_seed(0)
        config = T5Config(**SHAPE, tie_word_embeddings=True, decoder_start_token_id=0)
        model = T5ForConditionalGeneration(config).to(torch.bfloat16)
        model.save_pretrained(folder, max_shard_size="300MB")
    val, gen = WORK / "val.pt", torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (EVAL_SAMPLES, SEQ), generator=gen)
    labels = torch.randint(0, SHAPE["vocab_size"], (EVAL_SAMPLES, TARGET), generator=gen)
    torch.save({"input_ids": ids, "labels": labels}, val)
    info = compile_plan(WORK / f"pkg-{dtype}", str(folder), 2, hardware="cpu", schedule="gpipe",
                        partitioners="even-layers", task="xsum", seq_len=SEQ, target_len=TARGET,
                        micro_batch=1, batch=MICRO_BATCHES, dtype=dtype)  # fmt: skip
    plan = Plan.load(Path(info["output"]) / "plan.json")
    package = Path(info["package"])
    for schedule in schedules.split(","):
        name = f"{schedule}-{dtype}"
        argv = ["--steps", "4", "--schedule", schedule, "--eval-data", str(val)]
        argv += ["--eval-every", "3", "--checkpoint-dir", str(WORK / "ckpt" / name)]
        summary = run_package(package.parent, package.name, argv, WORK / f"{name}.json",
                              timeout=3600)  # fmt: skip
        planned = replace(plan, schedule=schedule)
        for rank, measured in enumerate(summary["memory_bytes"]):
            want = gpu_memory(planned, rank).total
            print(f"{name} rank {rank}: planned {want / 2**30:.3f} GiB, measured "
                  f"{measured / 2**30:.3f} GiB, {measured / want:.3f} of plan", flush=True)  # fmt: skip
        print(f"{name} losses {json.dumps(summary['losses'])}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
