"""Sharded optimizer state across replicas (ZeRO-1, `ftpipe_runtime.train.zero`): 2 replicas x 2
GPUs of the toy, each replica keeping half of every stage's masters and optimizer state,
train as the same run without sharding (the reference: the replicas' all-reduce and whole
optimizers), under gpipe, 1f1b and ftpipe, in fp32 and bf16; a sharded checkpoint resumes
exactly and has the unsharded format; the state each rank keeps is its chunks' alone, and
each replica sends what a reduce-scatter and an all-gather send instead of an all-reduce."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import crash_and_resume
from runtime_reference import checkpoint_params
from runtime_toy import PARAMS, STAGE_PARAMS, toy_plan

STEPS, M = 3, 2
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
ARGV = ["--steps", str(STEPS), "--data", "copy", "--optimizer", "adamw", "--lr", "0.05"]
ARGV += ["--weight-decay", "0.01", "--save-every", str(STEPS)]


def replicated(schedule: str, dtype: str = "fp32") -> dict:
    """2 replicas of the toy's two-rank pipeline (ranks 0, 1: replica 0)."""
    plan = toy_plan("two-ranks", schedule, M, DTYPES[dtype])
    return {**plan, "replicas": 2, "placement": [[0, 0], [0, 1], [1, 0], [1, 1]]}


def _pair(run_pipeline, tmp_path, plan, schedule, dtype, extra=()):
    """{"plain"|"sharded": (summary, checkpointed masters, trace)} of the run without and
    with --shard-optimizer."""
    out = {}
    for name, flag in (("plain", []), ("sharded", ["--shard-optimizer"])):
        ckpt, log, trace = (tmp_path / f"{name}{x}" for x in ("", ".json", ".trace.json"))
        argv = [*ARGV, *extra, "--schedule", schedule, "--dtype", dtype, *flag]
        argv += ["--checkpoint-dir", str(ckpt), "--log-json", str(log), "--trace", str(trace)]
        codes, ranks = run_pipeline(plan, argv, name=name)
        assert codes == [0] * 4, ranks.stderr()
        summary = json.loads(log.read_text())
        assert summary["replica_difference"] == 0.0  # every replica: the very same weights
        params = checkpoint_params(ckpt, STEPS, range(4))
        out[name] = (summary, params, json.loads(trace.read_text()))
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("schedule", "dtype", "clip"),
    [
        ("gpipe", "fp32", 0.0),
        pytest.param("1f1b", "fp32", 0.5, marks=pytest.mark.exhaustive),  # make test-all
        ("ftpipe", "fp32", 0.5),
        ("1f1b", "bf16", 0.5),
    ],
)
def test_sharded_run_equals_the_run_without(run_pipeline, tmp_path, schedule, dtype, clip):
    """Two stages a rank, each stage's state halved across its 2 replicas (stage 0's
    embedding cut between them), a weight read on the other rank; clipping by the norm over
    every shard of the pipeline (synchronous) or of the stage (ftpipe's own steps)."""
    plan = replicated(schedule, dtype)
    runs = _pair(run_pipeline, tmp_path, plan, schedule, dtype, ["--clip", str(clip)])
    (plain, want, _), (sharded, got, trace) = runs["plain"], runs["sharded"]
    assert got.keys() == want.keys() == PARAMS.keys()
    for name, value in want.items():
        assert got[name].dtype == torch.float32  # the fp32 masters, gathered whole
        if clip:  # the norm summed shard by shard: its last bits differ
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
        else:  # the same sums, the same elementwise update: bit for bit
            assert torch.equal(got[name], value), name
    assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-6)

    # What each rank keeps, measured on its tensors: its chunks of its stages' state (and of
    # the fp32 masters in bf16), AdamW's two moments an element and its step count (4 bytes)
    # a tensor or slice stepped. The toy's tensors are small, so the aligned chunks split
    # them unevenly; test_zero_parts measures half on larger ones.
    share = {rank: _layout_of(rank) for rank in range(4)}
    for rank, mine in share.items():
        whole = 2 * 4 * mine["elements"] + 4 * mine["tensors"]
        assert plain["optimizer_state_bytes"][rank] == whole
        assert (
            sharded["optimizer_state_bytes"][rank] == 2 * 4 * mine["stepped"] + 4 * mine["pieces"]
        )
        if dtype == "bf16":  # fp32 copies unsharded; chunks and a 4-byte stand-in a weight
            assert plain["master_bytes"][rank] == 4 * mine["elements"]
            assert sharded["master_bytes"][rank] == 4 * mine["chunks"] + 4 * mine["tensors"]
        else:  # the fp32 weights are their own masters; sharded, the chunks are apart
            assert plain["master_bytes"][rank] == 0
            assert sharded["master_bytes"][rank] == 4 * mine["chunks"]

    # The bytes each replica sends per step to sum gradients and share weights (ring counts).
    sent = {r["rank"]: r["sent"] for r in trace["ranks"]}
    plain_sent = {r["rank"]: r["sent"] for r in runs["plain"][2]["ranks"]}
    weight = torch.empty((), dtype=getattr(torch, DTYPES[dtype])).element_size()
    for rank, mine in share.items():
        n, padded = mine["elements"], 2 * mine["chunks"]
        assert plain_sent[rank]["grad all-reduce"][1] == STEPS * 4 * n  # 2 (d-1)/d 4N
        assert "grad all-reduce" not in sent[rank]
        assert sent[rank]["grad reduce-scatter"][1] == STEPS * 4 * padded // 2  # (d-1)/d 4N
        assert sent[rank]["weights all-gather"][1] == STEPS * weight * padded // 2  # (d-1)/d wN


def _layout_of(rank: int) -> dict[str, int]:
    """What the rank's stages hold whole and what its shards hold, by the layout rule: a
    stage's (small) tensors in one bucket, the last first, each at a multiple of 32
    elements, in 2 equal chunks of such multiples, the first the first replica's (the
    rank's place in its sorted stage group: ranks 0 and 1)."""
    out = dict.fromkeys(("elements", "tensors", "stepped", "pieces", "chunks"), 0)
    gpu, index = rank % 2, rank // 2  # placement: ranks 0, 1 replica 0; ranks 2, 3 replica 1
    aligned = lambda n: -(-n // 32) * 32  # noqa: E731
    for st in toy_plan("two-ranks")["stages"]:
        if st["gpu"] != gpu:
            continue
        sizes = [torch.Size(PARAMS[p]).numel() for p in reversed(STAGE_PARAMS[st["id"]])]
        starts = [sum(aligned(n) for n in sizes[:i]) for i in range(len(sizes))]
        chunk = aligned(-(-(starts[-1] + sizes[-1]) // 2))
        lo, hi = index * chunk, (index + 1) * chunk
        mine = [min(hi, a + n) - max(lo, a) for a, n in zip(starts, sizes, strict=True)]
        out["pieces"] += sum(n > 0 for n in mine)
        out["stepped"] += sum(n for n in mine if n > 0)
        out["elements"] += sum(sizes)
        out["tensors"] += len(sizes)
        out["chunks"] += chunk
    return out


@pytest.mark.multiproc
def test_resume_from_a_sharded_checkpoint_is_exact(run_pipeline, tmp_path):
    """Stopped after a checkpoint and resumed, a sharded 1f1b run ends with the weights and
    the losses of the uninterrupted one: the gathered masters and state load back into each
    replica's slices."""
    plan = replicated("1f1b")
    argv = ["--steps", "4", "--save-every", "2", "--data", "copy", "--optimizer", "adamw"]
    argv += ["--lr", "0.05", "--schedule", "1f1b", "--clip", "0.5", "--shard-optimizer"]
    whole, resumed = crash_and_resume(
        run_pipeline, tmp_path, plan, argv, range(4), fault="2:2:exit"
    )
    assert resumed["first_step"] == 2
    assert resumed["losses"] == whole["losses"][2:]


@pytest.mark.multiproc
@pytest.mark.exhaustive  # make test-all: the format is the same (test_zero_parts: gathered)
def test_a_sharded_checkpoint_resumes_without_sharding(run_pipeline, tmp_path):
    """The checkpoint format is the unsharded one: a sharded run stopped after its step-2
    checkpoint and resumed without --shard-optimizer ends, bit for bit, where the run
    straight through without it ends (gpipe, no clipping: the same sums)."""
    plan = replicated("gpipe")
    argv = ["--steps", "4", "--save-every", "2", "--data", "copy", "--optimizer", "adamw"]
    argv += ["--lr", "0.05", "--schedule", "gpipe"]
    logs = {}
    for name, folder, extra, env in [
        ("whole", "whole", [], {}),
        ("crash", "broken", ["--shard-optimizer"], {"FTPIPE_FAULT": "2:2:exit"}),
        ("resume", "broken", ["--resume"], {}),
    ]:
        log = tmp_path / f"{name}.json"
        own = [*argv, *extra, "--checkpoint-dir", str(tmp_path / folder), "--log-json", str(log)]
        codes, ranks = run_pipeline(plan, own, name=name, env=env)
        assert (codes == [0] * 4) == (name != "crash"), ranks.stderr()
        if name != "crash":
            logs[name] = json.loads(log.read_text())
    assert logs["resume"]["first_step"] == 2
    assert logs["resume"]["losses"] == logs["whole"]["losses"][2:]
    whole = checkpoint_params(tmp_path / "whole", 4, range(4))
    resumed = checkpoint_params(tmp_path / "broken", 4, range(4))
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
