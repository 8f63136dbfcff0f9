"""One rank of the GPT-2 bench model trained with torch.distributed.pipelining (gloo, CPU).

    torchrun --nproc_per_node 2 -m benchmarks.harness.pipelining_worker --plan plan.json --weights w.pt \\
        --blocks 4 --schedule 1f1b --steps 6 --result pipelining.json [--recompute]
    ... --blocks 2,2,2,2 --schedule zbv      # 4 stages on the ranks of the plan's stages

What a user of `torch.distributed.pipelining` writes for a 2-way split: each rank builds the
model, loads the weights, keeps its stage (`bench_reference.split_stages`), wraps it in a
`PipelineStage` and drives `ScheduleGPipe` / `Schedule1F1B` with HF's loss; one AdamW per
stage. The LM head on rank 1 and the embedding on rank 0 start as the same tied tensor but
are then two parameters that nothing keeps equal: pipelining has no notion of tied weights.
`--recompute` checkpoints each stage's forward, the extra work ftpipe's GPipe schedule does
(the others: every stage but the last). With a list of block counts, stage i gets counts[i]
blocks and sits on the plan's GPU of stage i (a loop for interleaved, a V for zbv); the
multi-stage schedules (zb1p, interleaved, zbv) drive every stage of the rank. The rank with
the last stage writes the losses and when each step ended.

`--runs runs.json` trains several configurations in one launch, one after the other, each
from the weights file with its own stages, schedule and optimizer (a list of objects with
the keys plan, blocks, schedule, recompute, result, and optionally fused: torch's fused
AdamW, as ftpipe's runtime steps): a launch's set-up is paid once.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.job.cpu_allocator import VARIABLE
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from benchmarks.harness.reference import (
    Recomputed,
    build_model,
    lm_loss,
    load_weights,
    split_chunks,
    step_batch,
)

SCHEDULES = {  # ftpipe's name -> pipelining's schedule of that name
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zb1p": ScheduleInterleavedZeroBubble,  # ZB-H1 with one stage per rank
    "interleaved": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
MULTI = {"zb1p", "interleaved", "zbv"}  # take a list of stages


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", help="plan.json: model, inputs, micro-batches")
    ap.add_argument("--weights", required=True, help="state dict every rank starts from")
    ap.add_argument("--blocks", help="blocks on stage 0 (of 2), or blocks per stage: 2,2,2,2")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--recompute", action="store_true", help="recompute as ftpipe does")
    ap.add_argument("--result", help="JSON written by the rank with the last stage")
    ap.add_argument("--runs", help="JSON list of runs (plan, blocks, schedule, recompute, result)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0, help="of the synthetic data")
    args = ap.parse_args(argv)
    if not args.runs and not (args.plan and args.blocks and args.result):
        ap.error("give --plan, --blocks and --result, or --runs")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit("the bench model is split in two: run 2 ranks")
    if args.runs:
        with open(args.runs) as f:
            runs = json.load(f)
    else:
        runs = [
            {k: getattr(args, k) for k in ("plan", "blocks", "schedule", "recompute", "result")}
        ]
    dist.init_process_group("gloo")
    for run in runs:
        train(run, args, rank)
        dist.barrier()
    dist.destroy_process_group()


def train(run: dict, args, rank: int) -> None:
    """One configuration: this rank's stages of a fresh model from the weights file."""
    from ftpipe_runtime.data.batches import make_data

    with open(run["plan"]) as f:
        plan = json.load(f)
    m = int(plan["micro_batches"])
    model = load_weights(build_model(plan["model"]["model_name"]), args.weights)
    counts = [int(b) for b in str(run["blocks"]).split(",")]
    if len(counts) == 1:
        counts.append(model.config.n_layer - counts[0])
    chunks = split_chunks(model, counts)
    last = len(chunks) - 1
    gpu_of = {s["id"]: s["gpu"] for s in plan.get("stages", ())} or {0: 0, 1: 1}
    if len(gpu_of) != len(chunks):
        raise SystemExit(
            f"--blocks {run['blocks']} makes {len(chunks)} stages, the plan {len(gpu_of)}"
        )
    mine = [i for i in range(len(chunks)) if gpu_of[i] == rank]
    modules = {
        i: Recomputed(chunks[i]) if run["recompute"] and i != last else chunks[i]
        for i in mine
    }  # fmt: skip
    del model
    stages = [PipelineStage(modules[i], i, len(chunks), torch.device("cpu")) for i in mine]
    name = run["schedule"]
    schedule = SCHEDULES[name](stages if name in MULTI else stages[0], m, loss_fn=lm_loss)
    # A V puts the embedding and the head, tied, on one rank: one parameter, stepped once.
    params = list({id(p): p for mod in modules.values() for p in mod.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=args.lr, fused=run.get("fused", False))
    data = make_data(plan["model"], None, args.seed)

    losses, ends = [], []
    dist.barrier()
    start = time.perf_counter()
    for k in range(args.steps):
        ids, labels = step_batch(data, k, m)
        kwargs: dict = {}
        if last in mine:
            mb_losses: list[torch.Tensor] = []
            kwargs = {"target": labels, "losses": mb_losses}
        schedule.step(*((ids,) if 0 in mine else ()), **kwargs)
        if last in mine:
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter() - start)
    if last in mine:
        # What torch's CPU allocator read when it loaded (nothing here changes it later).
        huge = os.environ.get(VARIABLE) == "1"
        result = {"losses": losses, "step_ends_s": ends, "schedule": name, "huge_pages": huge}
        write_atomic(run["result"], json.dumps(result))


if __name__ == "__main__":
    main()
