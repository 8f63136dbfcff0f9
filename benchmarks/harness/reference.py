"""The GPT-2 bench model as users hold it: whole, or cut by hand for torch.distributed.pipelining.

    model = build_model("gpt2-bench")                 # HF GPT2LMHeadModel, seeded init
    first, last = split_stages(model, blocks=4)       # embeddings + h[:4] | h[4:] + ln_f + lm_head
    loss = lm_loss(last(first(ids)), labels)          # == model(input_ids=ids, labels=labels).loss
    ids, labels = step_batch(make_data(plan["model"], None, 0), step=0, micro_batches=4)

Every contender reads the runtime's own synthetic data (`ftpipe_runtime.data.batches`), so step k
sees the same micro-batches everywhere. Stages are built by hand: pipelining's tracer
(`pipeline()`) fails on backward through skip connections.

As a script it trains the whole model in one process (section 3c):

    python -m benchmarks.harness.reference --plan plan.json --weights w.pt --steps 6 --result r.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from ftpipe_runtime.atomic import write_atomic
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # label of padding (HF's ignore_index)


def build_model(name: str, seed: int = 0) -> nn.Module:
    """The HF model of a shipped spec, randomly initialised from `seed`, in train mode."""
    from ftpipe_compiler.model.zoo import resolve_model

    return resolve_model(name).build("cpu", seed=seed).m


def load_weights(model: nn.Module, path: str) -> nn.Module:
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss (`ForCausalLMLoss`): position t predicts label t + 1, in float32."""
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE
    )


class EmbedAndBlocks(nn.Module):
    """Stage 0: token and position embeddings, then the first `blocks` transformer blocks."""

    def __init__(self, model: nn.Module, blocks: int):
        super().__init__()
        t = model.transformer
        self.wte, self.wpe, self.h = t.wte, t.wpe, nn.ModuleList(t.h[:blocks])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)[None]
        for block in self.h:  # no mask given: HF's SDPA attention is then causal
            x = block(x)
        return x


class BlocksAndHead(nn.Module):
    """Stage 1: the remaining blocks, the final layer norm and the LM head (logits)."""

    def __init__(self, model: nn.Module, blocks: int):
        super().__init__()
        t = model.transformer
        self.h, self.ln_f, self.lm_head = nn.ModuleList(t.h[blocks:]), t.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            hidden = block(hidden)
        return self.lm_head(self.ln_f(hidden))


class Blocks(nn.Module):
    """A stage between the two: blocks [start, end)."""

    def __init__(self, model: nn.Module, start: int, end: int):
        super().__init__()
        self.h = nn.ModuleList(model.transformer.h[start:end])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            hidden = block(hidden)
        return hidden


class Recomputed(nn.Module):
    """A stage that keeps only its input and recomputes its forward at backward (activation
    checkpointing): the work ftpipe's schedules do on every stage that recomputes."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def split_stages(model: nn.Module, blocks: int) -> tuple[nn.Module, nn.Module]:
    """Both stages of a 2-way split after block `blocks`; they share the model's tensors."""
    return EmbedAndBlocks(model, blocks), BlocksAndHead(model, blocks)


def split_chunks(model: nn.Module, counts: list[int]) -> list[nn.Module]:
    """Stages of counts[i] blocks each, in chain order (the first embeds, the last has the
    final norm and the head); two counts are `split_stages`."""
    ends = [sum(counts[: i + 1]) for i in range(len(counts))]
    middle = [Blocks(model, ends[i - 1], ends[i]) for i in range(1, len(counts) - 1)]
    return [EmbedAndBlocks(model, ends[0]), *middle, BlocksAndHead(model, ends[-2])]


def step_batch(data, step: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of optimizer step `step`: its micro-batches stacked in order, so
    splitting it into `micro_batches` chunks gives back the runtime's micro-batches."""
    mbs = range(step * micro_batches, (step + 1) * micro_batches)
    ids = torch.cat([data.get("input_ids", m) for m in mbs])
    labels = torch.cat([data.get("labels", m) for m in mbs])
    return ids, labels


def train_single(plan: dict, weights: str, steps: int, lr: float, seed: int) -> dict:
    """The unpartitioned model, the whole batch at once, AdamW: losses and step end times."""
    from ftpipe_runtime.data.batches import make_data

    model = load_weights(build_model(plan["model"]["model_name"]), weights)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)  # the runtime's default
    data = make_data(plan["model"], None, seed)
    m = int(plan["micro_batches"])
    losses, ends = [], []
    start = time.perf_counter()
    for k in range(steps):
        ids, labels = step_batch(data, k, m)
        loss = lm_loss(model(input_ids=ids, use_cache=False).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        ends.append(time.perf_counter() - start)
    return {"losses": losses, "step_ends_s": ends, "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the unpartitioned model in one process.")
    ap.add_argument("--plan", required=True, help="plan.json: model, inputs, micro-batches")
    ap.add_argument("--weights", required=True, help="state dict to start from")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0, help="of the synthetic data")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with open(args.plan) as f:
        plan = json.load(f)
    result = train_single(plan, args.weights, args.steps, args.lr, args.seed)
    write_atomic(args.result, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
