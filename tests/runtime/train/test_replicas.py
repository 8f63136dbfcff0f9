"""Data parallelism: 2 replicas x 2 GPUs train exactly as one process on the whole batch,
with the ranks launched directly (on samples of different lengths: the step's loss is its
label tokens' mean over every replica), and as two torchrun "nodes" on this machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from runtime_helpers import RUNTIME_HOME, TOY
from runtime_reference import checkpoint_params, train_plain
from runtime_toy import toy_plan, write_ragged

pytestmark = pytest.mark.multiproc

STEPS = 3
PLACEMENTS = {  # rank -> (replica, GPU of the pipeline)
    "pipeline": [[0, 0], [0, 1], [1, 0], [1, 1]],
    "replica": [[0, 0], [1, 0], [0, 1], [1, 1]],
}


def replicated(schedule: str, orientation: str) -> dict:
    return {**toy_plan("two-ranks", schedule), "replicas": 2, "placement": PLACEMENTS[orientation]}


def check_against_one_process(plan, log, ckpt, optimizer: str, clip: float, data=None) -> None:
    """Losses and every step's weights equal plain training on all replicas' micro-batches."""
    whole = {**plan, "micro_batches": plan["replicas"] * plan["micro_batches"]}
    losses, params = train_plain(whole, STEPS, optimizer, lr=0.05, clip=clip, data=data)
    got = json.loads(log.read_text())
    assert got["losses"] == pytest.approx(losses, rel=1e-4)
    assert got["replica_difference"] == 0.0  # the replicas hold the very same weights
    for step in range(STEPS):
        pipeline = checkpoint_params(ckpt, step + 1, range(4))
        assert pipeline.keys() == params[step].keys()
        for name, value in params[step].items():
            torch.testing.assert_close(pipeline[name], value, rtol=1e-4, atol=1e-6, msg=name)


def argv(schedule, optimizer, clip, ckpt, log) -> list[str]:
    out = ["--steps", str(STEPS), "--optimizer", optimizer, "--lr", "0.05", "--clip", str(clip)]
    out += ["--schedule", schedule, "--save-every", "1", "--checkpoint-dir", str(ckpt)]
    return out + ["--log-json", str(log)]


@pytest.mark.parametrize(
    ("schedule", "orientation", "optimizer", "clip"),
    [("gpipe", "pipeline", "adamw", 1.0), ("1f1b", "replica", "sgd", 0.5)],
)
def test_two_replicas_train_as_one_process(
    run_pipeline, tmp_path, schedule, orientation, optimizer, clip
):
    plan = replicated(schedule, orientation)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    data = write_ragged(tmp_path / "ragged.jsonl")
    codes, ranks = run_pipeline(plan, [*argv(schedule, optimizer, clip, ckpt, log), "--data", data])
    assert codes == [0] * 4, ranks.stderr()
    check_against_one_process(plan, log, ckpt, optimizer, clip, data)
    # Stage files are written once, by the first replica; every rank marks its part done.
    files = sorted(p.name for p in (ckpt / "step-000001").iterdir())
    stage_files = sorted({f.split(".")[0] for f in files if f.startswith("stage-")})
    assert stage_files == [f"stage-{s}" for s in range(4)], files  # by replica 0 only
    assert {f"rank-{r}.json" for r in range(4)} <= set(files), files


@pytest.mark.parametrize("orientation", ["replica", "pipeline"])
def test_two_replicas_evaluate_as_one_process(run_pipeline, tmp_path, orientation):
    """With replicas, rank 0's replica evaluates (they hold the same weights): the loss stage
    of that pipeline (rank 2 or 1) sends each round's result to rank 0, whose log has every
    round, each the whole model's token-weighted loss on the evaluation set at that step's
    weights."""
    from ftpipe_runtime.data.batches import make_data
    from ftpipe_runtime.train.loss_weights import loss_items
    from runtime_toy import ToyModel

    plan = replicated("gpipe", orientation)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    data = write_ragged(tmp_path / "ragged.jsonl")
    val = write_ragged(tmp_path / "val.jsonl", samples=7)
    run = [*argv("gpipe", "adamw", 1.0, ckpt, log), "--data", data]
    codes, ranks = run_pipeline(plan, [*run, "--eval-data", val, "--eval-every", "1"])
    assert codes == [0] * 4, ranks.stderr()
    check_against_one_process(plan, log, ckpt, "adamw", 1.0, data)
    whole = {**plan, "micro_batches": plan["replicas"] * plan["micro_batches"]}
    _, params = train_plain(whole, STEPS, "adamw", lr=0.05, clip=1.0, data=data)
    evals = make_data(plan["model"], val, 0, evaluation=True)
    want = []
    for step in range(STEPS):
        net = ToyModel()
        net.load_state_dict(params[step])
        with torch.no_grad():
            items = [loss_items(evals, b) for b in range(evals.micro_batches)]
            losses = [net(**{n: evals.get(n, b) for n in plan["model"]["inputs"]})
                      for b in range(evals.micro_batches)]  # fmt: skip
        want.append(sum(float(x) * n for x, n in zip(losses, items)) / sum(items))
    got = json.loads(log.read_text())["evals"]
    assert [e["step"] for e in got] == [1, 2, 3]
    assert [e["samples"] for e in got] == [7] * STEPS  # the set once, not once per replica
    assert [e["loss"] for e in got] == pytest.approx(want, rel=1e-4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_on_localhost(tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 2` twice, meeting through a c10d rendezvous."""
    plan = replicated("1f1b", "pipeline")
    plan_file, ckpt, log = tmp_path / "plan.json", tmp_path / "ckpt", tmp_path / "log.json"
    plan_file.write_text(json.dumps(plan))
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([RUNTIME_HOME, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    cmd += ["--nproc_per_node", "2", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ftpipe-test"]
    cmd += [str(TOY), str(plan_file), *argv("1f1b", "adamw", 1.0, ckpt, log)]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=open(f, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        for f in logs
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    output = "\n".join(f.read_text() for f in logs)
    assert codes == [0, 0], output
    check_against_one_process(plan, log, ckpt, "adamw", 1.0)
