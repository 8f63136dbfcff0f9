"""The executor on one rank, with hand-written action lists, and `run` without torch.distributed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ftpipe_runtime import run
from ftpipe_runtime.comm import Comm
from ftpipe_runtime.data import make_data
from ftpipe_runtime.dataflow import build_dataflow, check_progress
from ftpipe_runtime.executor import Executor
from ftpipe_runtime.optim import make_optimizer
from ftpipe_runtime.schedules import Action
from ftpipe_runtime.stepping import Stepper
from ftpipe_runtime.topology import Topology
from runtime_reference import train_plain
from runtime_toy import STAGES, Stage1, one_rank_plan, toy_plan


class DropStage1(Stage1):
    def forward(self, h0, x0):
        return {"h1": F.dropout(torch.tanh(F.linear(h0 + x0, self.l1.weight, self.l1.bias)), 0.5)}


def _train_once(plan, classes, recompute: bool, seed: int) -> dict:
    """One step of 4 micro-batches, all forwards then all backwards, on one rank."""
    topo = Topology(plan)
    m = plan["micro_batches"]
    acts = [Action("F", s, mb) for mb in range(m) for s in range(4)]
    acts += [Action("B", s, mb, recompute and s != 3) for mb in range(m) for s in (3, 2, 1, 0)]
    acts += [Action("S", s, 0) for s in range(4)]
    lists = {0: acts}
    flow = build_dataflow(topo, lists, m, synchronous=True)
    check_progress(topo, lists, flow)
    modules = {s: classes[s]() for s in range(4)}
    opts = {s: make_optimizer("sgd", mod.parameters(), 0.1) for s, mod in modules.items()}
    comm = Comm(0, 1, "cpu", 5, flow, None)
    stepper = Stepper(topo, 0, modules, opts, comm, flow.events[0], lambda k: 0.1, 0.0)
    data = make_data(plan["model"], None, 0)
    torch.manual_seed(seed)
    Executor(topo, 0, modules, flow, comm, data, stepper, m, "cpu").run(acts)
    return {n: p.detach().clone() for s in modules.values() for n, p in s.named_parameters()}


def test_recompute_replays_the_forwards_dropout():
    plan, classes = one_rank_plan(), {**STAGES, 1: DropStage1}
    kept = _train_once(plan, classes, recompute=False, seed=1)
    again = _train_once(plan, classes, recompute=True, seed=1)
    other = _train_once(plan, classes, recompute=True, seed=2)
    for name in kept:
        torch.testing.assert_close(again[name], kept[name], rtol=0, atol=0)
    assert any(not torch.equal(other[n], kept[n]) for n in kept)  # the masks do matter


def test_run_on_one_rank_matches_plain_training(tmp_path):
    plan = one_rank_plan("1f1b")
    argv = ["--steps", "3", "--optimizer", "adamw", "--lr", "0.05", "--clip", "0.5"]
    summary = run(plan, STAGES, argv + ["--checkpoint-dir", str(tmp_path)])
    losses, _ = train_plain(plan, 3, "adamw", lr=0.05, clip=0.5)
    assert summary["losses"] == pytest.approx(losses, rel=1e-5)


def test_run_refuses_the_wrong_number_of_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="the plan is for 2 GPUs but 1 processes"):
        run(toy_plan("two-ranks"), STAGES, ["--steps", "1"])


def test_run_refuses_a_package_that_disagrees_with_its_plan():
    plan = one_rank_plan()
    with pytest.raises(SystemExit, match="stage 1 takes"):
        run(plan, {**STAGES, 1: STAGES[2]}, ["--steps", "1"])
