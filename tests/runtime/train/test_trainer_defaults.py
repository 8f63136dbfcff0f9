"""The update rule's defaults and schedules are the HuggingFace Trainer's: each learning-rate
schedule against transformers' scheduler on the same optimizer at every step, AdamW's
defaults against TrainingArguments', weight decay kept off biases and norm weights."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime.job.options import parse_args
from ftpipe_runtime.train.optim import DECAYS, lr_at, make_optimizer, wsd_decay_steps

transformers = pytest.importorskip("transformers")

STEPS, LR = 20, 0.3


def _theirs(name: str, opt, steps: int, warmup: int, fraction: float):
    if name == "constant":
        return transformers.get_constant_schedule_with_warmup(opt, warmup)
    if name == "linear":
        return transformers.get_linear_schedule_with_warmup(opt, warmup, steps)
    if name == "cosine":
        return transformers.get_cosine_schedule_with_warmup(opt, warmup, steps)
    decay = wsd_decay_steps(steps, warmup, fraction)
    return transformers.get_wsd_schedule(
        opt, warmup, decay, num_training_steps=steps, decay_type="linear"
    )


@pytest.mark.parametrize("warmup", [0, 1, 5])
@pytest.mark.parametrize("name", list(DECAYS))
def test_each_schedule_is_transformers_at_every_step(name, warmup):
    fraction = 0.25
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = _theirs(name, opt, STEPS, warmup, fraction)
    for k in range(STEPS):
        assert lr_at(k, LR, STEPS, warmup, name, fraction) == pytest.approx(
            opt.param_groups[0]["lr"], abs=1e-15
        ), f"step {k}"
        opt.step()
        sched.step()


def test_wsd_keeps_the_peak_then_decays_over_the_last_fraction():
    lrs = [lr_at(k, 1.0, 20, 2, "wsd", 0.1) for k in range(20)]
    assert lrs[:3] == [0.0, 0.5, 1.0]
    assert lrs[2:18] == [1.0] * 16
    assert lrs[18:] == [1.0, 0.5]  # 2 decay steps: linearly towards 0


def test_an_unknown_schedule_is_a_value_error_listing_the_choices(capsys):
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'; choose from "
                       "constant, linear, cosine, wsd"):  # fmt: skip
        lr_at(0, 1.0, 10, decay="step")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--decay", "step"], {"model": {}})
    assert exit_.value.code == 2
    assert "invalid choice: 'step'" in capsys.readouterr().err


def test_adamw_defaults_are_the_trainers():
    ours = parse_args([], {"model": {}}).hyper
    theirs = transformers.TrainingArguments(output_dir="unused", report_to=[])
    assert ours.weight_decay == theirs.weight_decay == 0.0
    assert ours.betas == (theirs.adam_beta1, theirs.adam_beta2)
    assert ours.eps == theirs.adam_epsilon
    opt = make_optimizer("adamw", [torch.nn.Parameter(torch.ones(2, 2))], 1e-3, ours)
    assert opt.param_groups[0]["weight_decay"] == 0.0  # not torch's AdamW default of 0.01
    assert opt.param_groups[0]["betas"] == (0.9, 0.999) and opt.param_groups[0]["eps"] == 1e-8


def test_weight_decay_leaves_biases_and_norm_weights_alone():
    args = parse_args(
        ["--weight-decay", "0.1", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
         "--adam-epsilon", "1e-6"],
        {"model": {}},
    )  # fmt: skip
    hyper = args.hyper
    weight = torch.nn.Parameter(torch.ones(3, 4))
    bias, norm = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = make_optimizer("adamw", [weight, bias, norm], 0.5, hyper)
    groups = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert groups[0.1] == [weight] and groups[0.0] == [bias, norm]
    for g in opt.param_groups:
        assert g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6
    # a zero gradient: AdamW's step is then the decay alone, lr * wd of the weight
    for p in (weight, bias, norm):
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(weight.detach(), torch.full((3, 4), 1 - 0.5 * 0.1))
    torch.testing.assert_close(bias.detach(), torch.ones(3))
    torch.testing.assert_close(norm.detach(), torch.ones(4))
