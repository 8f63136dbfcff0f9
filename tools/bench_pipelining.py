"""One rank of the GPT-2 bench model trained with torch.distributed.pipelining (gloo, CPU).

    torchrun --nproc_per_node 2 tools/bench_pipelining.py --plan plan.json --weights w.pt \\
        --blocks 4 --schedule 1f1b --steps 6 --result pipelining.json [--recompute]

What a user of `torch.distributed.pipelining` writes for a 2-way split: each rank builds the
model, loads the weights, keeps its stage (`bench_reference.split_stages`), wraps it in a
`PipelineStage` and drives `ScheduleGPipe` / `Schedule1F1B` with HF's loss; one AdamW per
stage. The LM head on rank 1 and the embedding on rank 0 start as the same tied tensor but
are then two parameters that nothing keeps equal: pipelining has no notion of tied weights.
`--recompute` checkpoints each stage's forward, the extra work ftpipe's GPipe schedule does
(1F1B: every stage but the last). The last rank writes the losses and when each step ended.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from bench_reference import Recomputed, build_model, lm_loss, load_weights, split_stages, step_batch
from ftpipe_runtime.atomic import write_atomic
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
RECOMPUTES = {  # which stages recompute, as ftpipe's schedule of that name does
    "gpipe": lambda rank, last: True,
    "1f1b": lambda rank, last: rank != last,
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan.json: model, inputs, micro-batches")
    ap.add_argument("--weights", required=True, help="state dict every rank starts from")
    ap.add_argument("--blocks", type=int, required=True, help="transformer blocks on rank 0")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--recompute", action="store_true", help="recompute as ftpipe does")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0, help="of the synthetic data")
    ap.add_argument("--result", required=True)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    from ftpipe_runtime.data import make_data

    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit("the bench model is split in two: run 2 ranks")
    dist.init_process_group("gloo")
    with open(args.plan) as f:
        plan = json.load(f)
    m = int(plan["micro_batches"])

    model = load_weights(build_model(plan["model"]["model_name"]), args.weights)
    module = split_stages(model, args.blocks)[rank]
    if args.recompute and RECOMPUTES[args.schedule](rank, world - 1):
        module = Recomputed(module)
    del model
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=m, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    data = make_data(plan["model"], None, args.seed)

    losses, ends = [], []
    dist.barrier()
    start = time.perf_counter()
    for k in range(args.steps):
        ids, labels = step_batch(data, k, m)
        if rank == 0:
            schedule.step(ids)
        else:
            mb_losses: list[torch.Tensor] = []
            schedule.step(target=labels, losses=mb_losses)
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter() - start)
    if rank == world - 1:
        result = {"losses": losses, "step_ends_s": ends, "schedule": args.schedule}
        write_atomic(args.result, json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
