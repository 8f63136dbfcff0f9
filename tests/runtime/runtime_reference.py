"""Single-process references for the toy pipeline: plain training, FTPipe's update rule, and
the stage-wise delayed rules of PipeDream-2BW and WPipe.

Written apart from the runtime's own update rule, as the HuggingFace Trainer trains: a step's
loss is the sum over its label tokens over their number (each micro-batch's mean loss
weighted by its share of the step's counted tokens: `step_shares`), torch's optimizers with the
Trainer's defaults (no weight decay), the learning rate decayed linearly to 0 (no warm-up)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from ftpipe_runtime.data.batches import make_data
from ftpipe_runtime.models.hf import loss_of as hf_loss
from ftpipe_runtime.stage.api import run_in_one_process
from ftpipe_runtime.train.loss_weights import loss_items
from runtime_toy import STAGES, ToyModel
from safetensors.torch import load_file
from torch.func import functional_call

# The Trainer's AdamW defaults (betas, epsilon: torch's too); no weight decay.
_OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
}


def reference_optimizer(name, params, lr):
    return _OPTIMIZERS[name]([p for p in params if p.requires_grad], lr)


def linear_lr(k: int, lr: float, steps: int) -> float:
    """transformers' linear schedule without warm-up: lr * (steps - k) / steps."""
    return lr * (steps - k) / steps


def _counted(plan, source, mb: int) -> int:
    """The label tokens the loss of micro-batch mb averages over: labels not -100, a causal
    LM's from the second token (the model shifts them); samples for per-sample heads."""
    head = plan["model"].get("head")
    if head in ("sequence-classification", "question-answering"):
        return next(iter(plan["model"]["inputs"].values()))[0][0]
    labels = source.get("labels", mb)
    return int((labels[:, 1:] if head == "causal-lm" else labels).ne(-100).sum())


def step_shares(plan, source, k: int) -> dict[int, float]:
    """mb -> its share of step k's counted tokens (each micro-batch's loss is a mean)."""
    m = plan["micro_batches"]
    counts = {mb: _counted(plan, source, mb) for mb in range(k * m, (k + 1) * m)}
    total = sum(counts.values())
    return {mb: n / total for mb, n in counts.items()}


def train_plain(
    plan, steps, optimizer="adamw", lr=0.01, clip=0.0, seed=0, data=None, model=None, text=None
):
    """The unpartitioned model (the toy's, or `model`: a HuggingFace one), gradient
    accumulation over the plan's micro-batches. `text`: TextOptions of a `data` text file
    (tokenized by the model's folder)."""
    model = model if model is not None else ToyModel()
    loss_of = hf_loss if hasattr(model, "config") else lambda net, inputs: net(**inputs)
    opt = reference_optimizer(optimizer, model.parameters(), lr)
    tokenizer = plan["model"].get("path") if text is not None else None
    source = make_data(plan["model"], data, seed, text, tokenizer)
    losses, params = [], []
    for k in range(steps):
        total = 0.0
        for mb, share in step_shares(plan, source, k).items():
            loss = loss_of(model, {n: source.get(n, mb) for n in plan["model"]["inputs"]})
            (loss * share).backward()
            total += loss.item() * share
        losses.append(total)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for group in opt.param_groups:
            group["lr"] = linear_lr(k, lr, steps)
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def train_stale(
    plan, lists, steps, optimizer="adamw", lr=0.01, seed=0, data=None, stages=None, init=None,
    lag=0, evaluate=None,
):  # fmt: skip
    """FTPipe's rule, evaluated lazily: the forward of (stage, mb) uses the stage's weights
    after the steps that precede it in its GPU's action list (stale); a backward recomputes
    with the weights current at that backward from the stale forward's inputs; the loss
    stage backpropagates through its forward. A weight read by several stages belongs to
    the first: it is an output of that stage's forward, so a reader uses the owner's value
    at the owner's forward of the micro-batch (and keeps it when it recomputes), and the
    readers' gradients reach the owner's parameter through the owner's backward.
    `stages`: the stage classes (the toy's by default); `init`: a state dict to start from.
    `lag`: each step's new weights reach the actions only `lag` steps of the stage later (an
    offloaded step that lands at the stage's next S: `--offload-step lagged`), so an action
    after n of its stage's steps reads version max(n - lag, 0) (a dict: per stage).
    `evaluate`: (an evaluation source, micro-batches): each one's evaluation loss, every
    stage in eval mode with the weights the forward of that micro-batch reads on it (None:
    every stage's final weights), the batches' losses weighted by their items.
    Returns per-step losses and each stage's final weights (and those evaluation losses)."""
    classes = stages or STAGES
    m = plan["micro_batches"]
    source = make_data(plan["model"], data, seed)
    transfers = {t["tensor"]: t for t in plan["transfers"]}
    stages = {s["id"]: s for s in plan["stages"]}
    loss_stage = plan["loss_stage"]
    v_f, v_b = {}, {}
    for acts in lists.values():
        done: dict[int, int] = {}
        for a in acts:
            if a.kind == "S":
                done[a.stage] = done.get(a.stage, 0) + 1
            else:
                behind = lag.get(a.stage, 0) if isinstance(lag, dict) else lag
                v = max(done.get(a.stage, 0) - behind, 0)
                (v_f if a.kind == "F" else v_b)[(a.stage, a.mb)] = v
    modules = {s: classes[s]() for s in stages}
    for module in modules.values():
        if init is not None:
            own = module.state_dict()
            module.load_state_dict({k: v for k, v in init.items() if k in own}, strict=False)
    opts = {s: reference_optimizer(optimizer, mod.parameters(), lr) for s, mod in modules.items()}
    shares = functools.cache(lambda k: step_shares(plan, source, k))
    versions = {s: [_snapshot(mod)] for s, mod in modules.items()}

    def weights(s, v):
        while len(versions[s]) <= v:
            advance(s)
        return versions[s][v]

    def inputs_of(s, mb):
        x = {n: source.get(n, mb) for n in stages[s]["model_inputs"]}
        return x | {t: forward(transfers[t]["producer"], mb)[t] for t in stages[s]["inputs"]}

    @functools.cache
    def forward(s, mb):
        params, x = weights(s, v_f[(s, mb)]), inputs_of(s, mb)
        with torch.no_grad():
            return functional_call(modules[s], params, kwargs=x)

    @functools.cache
    def backward(s, mb):
        v = v_f[(s, mb)] if s == loss_stage else v_b[(s, mb)]
        params = {n: p.clone().requires_grad_(True) for n, p in weights(s, v).items()}
        x = {
            n: t.clone().requires_grad_(t.is_floating_point()) for n, t in inputs_of(s, mb).items()
        }
        out = functional_call(modules[s], params, kwargs=x)
        share = shares(mb // m)[mb]
        roots, grads = ([out["loss"] * share], [None]) if s == loss_stage else ([], [])
        for t in stages[s]["outputs"]:
            if transfers[t]["requires_grad"]:
                roots.append(out[t])
                grads.append(sum(backward(c, mb)[0][t] for c in transfers[t]["consumers"]))
        torch.autograd.backward(roots, grads)
        return {n: t.grad for n, t in x.items()}, {n: p.grad for n, p in params.items()}

    def advance(s):
        k = len(versions[s]) - 1
        for name, p in modules[s].named_parameters():
            p.grad = sum(backward(s, mb)[1][name] for mb in range(k * m, k * m + m))
        for group in opts[s].param_groups:
            group["lr"] = linear_lr(k, lr, steps)
        opts[s].step()
        opts[s].zero_grad()
        versions[s].append(_snapshot(modules[s]))

    losses = [
        sum(float(forward(loss_stage, mb)["loss"]) * w for mb, w in shares(k).items())
        for k in range(steps)
    ]
    finals = {s: weights(s, steps) for s in stages}
    if evaluate is None:
        return losses, finals
    evals, at = evaluate

    def eval_forward(s, b, mb):
        params = finals[s] if mb is None else weights(s, v_f[(s, mb)])
        x = {n: evals.get(n, b) for n in stages[s]["model_inputs"]}
        x |= {t: eval_forward(transfers[t]["producer"], b, mb)[t] for t in stages[s]["inputs"]}
        modules[s].eval()
        with torch.no_grad():
            return functional_call(modules[s], params, kwargs=x)

    def eval_loss(mb):
        items = [loss_items(evals, b) for b in range(evals.micro_batches)]
        total = sum(float(eval_forward(loss_stage, b, mb)["loss"]) * n for b, n in enumerate(items))
        return total / sum(items)

    return losses, finals, [eval_loss(mb) for mb in at]


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def checkpoint_params(root, step: int, stages) -> dict[str, torch.Tensor]:
    """All parameters of a pipeline checkpoint by name; each must be in exactly one stage."""
    out: dict[str, torch.Tensor] = {}
    for s in stages:
        state = load_file(str(Path(root) / f"step-{step:06d}" / f"stage-{s}.safetensors"))
        for name, value in state.items():
            assert name not in out, f"{name} is held by two stages"
            out[name] = value
    return out


def train_delayed(
    plan, steps, delay_of, optimizer="adamw", lr=0.01, seed=0, data=None, stages=None, init=None
):
    """A stage-wise delayed update in one process: step k's gradient is taken at each stage's
    weights after max(k - delay, 0) of its steps, and applied to its newest weights,
    W(t+1) = W(t) - lr * grad f(W(t - delay)). Every stage delay 1 is PipeDream-2BW's rule;
    G0 stages 1 and G1 stages 0 is WPipe's (2GW eq. 1); all 0 is plain training. A weight
    read by several stages follows its owner stage (the lowest reader). Returns per-step
    losses and each stage's final weights."""
    classes = stages or STAGES
    ids = [s["id"] for s in plan["stages"]]
    source = make_data(plan["model"], data, seed)
    live = {s: classes[s]() for s in ids}
    work = {s: classes[s]() for s in ids}  # loaded with the version a step computes on
    if init is not None:
        for module in live.values():
            own = module.state_dict()
            module.load_state_dict({k: v for k, v in init.items() if k in own}, strict=False)
    opts = {s: reference_optimizer(optimizer, live[s].parameters(), lr) for s in ids}
    history = {s: [_snapshot(live[s])] for s in ids}
    losses = []
    for k in range(steps):
        for s in ids:
            state = history[s][max(k - delay_of[s], 0)]
            with torch.no_grad():
                for n, p in work[s].named_parameters():
                    p.copy_(state[n])
        total = 0.0
        grads = {s: {} for s in ids}  # the step's gradients, each micro-batch's by its share
        for mb, share in step_shares(plan, source, k).items():
            for s in ids:
                for p in work[s].parameters():
                    p.grad = None
            inputs = {n: source.get(n, mb) for n in plan["model"]["inputs"]}
            total += float(run_in_one_process(work, plan, inputs).detach()) * share
            for s in ids:
                for n, p in work[s].named_parameters():
                    if p.grad is not None:
                        have = grads[s].get(n)
                        grads[s][n] = p.grad * share if have is None else have + p.grad * share
        losses.append(total)
        for s in ids:
            for n, p in live[s].named_parameters():
                p.grad = grads[s].get(n)
            for group in opts[s].param_groups:
                group["lr"] = linear_lr(k, lr, steps)
            opts[s].step()
            opts[s].zero_grad()
            history[s].append(_snapshot(live[s]))
    return losses, {s: history[s][-1] for s in ids}
