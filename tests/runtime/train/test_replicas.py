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
