"""The step log of a 2-rank run: lines with time, rank and every figure on rank 0 (none under
-q), the same figures one JSON object a step in log.jsonl, TensorBoard and W&B; where the
outputs go and that the data is synthetic, said once; the gradient norm the one a single
process computes."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch
from click.testing import CliRunner
from ftpipe_runtime.data.batches import make_data
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.job.runlog import RunLog
from ftpipe_runtime.train.optim import lr_at, make_optimizer

pytest.importorskip("transformers")
from ftpipe_compiler.cli import cli  # noqa: E402
from ftpipe_compiler.model.zoo import resolve_model  # noqa: E402

STEPS, CLIP, LR = 3, 0.5, 1e-2
FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "peak_memory_bytes", "eta_s")
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d rank (\d) (\w+) +"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A tiny GPT-2 package on 2 GPUs (gpipe: it clips over the whole pipeline), and the
    model's initial weights for --init."""
    out = tmp_path_factory.mktemp("steplog")
    argv = ["compile", "--model", "gpt2-tiny", "--gpus", "2", "--schedule", "gpipe",
            "-p", "even-layers", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    init = out / "init.pt"
    torch.save(resolve_model("gpt2-tiny").build("cpu", dropout=0.0, seed=0).m.state_dict(), init)
    pkg = out / "gpt2_tiny_pipeline"
    return pkg, json.loads((pkg / "plan.json").read_text()), init


def _norms(plan) -> list[float]:
    """Each step's gradient norm before clipping, in one process (AdamW, clipped, decayed)."""
    net = resolve_model("gpt2-tiny").build("cpu", dropout=0.0, seed=0).m
    opt = make_optimizer("adamw", net.parameters(), LR)
    data, m = make_data(plan["model"], None, 0), plan["micro_batches"]
    norms = []
    for k in range(STEPS):
        for mb in range(k * m, (k + 1) * m):
            inputs = {n: data.get(n, mb) for n in plan["model"]["inputs"]}
            (net(**inputs, use_cache=False).loss / m).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        for group in opt.param_groups:
            group["lr"] = lr_at(k, LR, STEPS)
        opt.step()
        opt.zero_grad()
    return norms


def _run(run_pipeline, package, tmp_path, name, extra=(), env=None):
    pkg, plan, init = package
    summary = tmp_path / f"{name}.json"
    argv = ["--steps", str(STEPS), "--schedule", "gpipe", "--init", str(init), "--clip",
            str(CLIP), "--lr", str(LR), "--device", "cpu", "--log-json", str(summary), *extra]  # fmt: skip
    codes, ranks = run_pipeline(plan, argv, name=name, module=pkg.name, cwd=pkg.parent, env=env)
    assert codes == [0, 0], ranks.stderr()
    return json.loads(summary.read_text()), ranks


@pytest.mark.multiproc
@pytest.mark.slow
def test_step_lines_log_jsonl_and_tensorboard(run_pipeline, package, tmp_path):
    logs = tmp_path / "logs"
    summary, ranks = _run(run_pipeline, package, tmp_path, "loud", ["--log-dir", str(logs)])
    err0, err1 = ranks.stderr(0), ranks.stderr(1)
    lines = [x for x in err0.splitlines() if re.match(STAMP, x)]
    steps = [x for x in lines if re.match(STAMP + r"step \d/", x)]
    assert len(steps) == STEPS, err0
    for line in steps:  # step/total, then every figure the run has (no MFU on a CPU)
        assert re.search(
            r"step \d/3  loss \d\.\d{4}  lr \S+  grad_norm \S+  [\d,]+ tokens/s  [\d.]+ "
            r"samples/s  mem [\d.]+ \w+  eta \d+:\d\d:\d\d$",
            line,
        ), line
    assert all(re.match(STAMP, x).group(1) == "0" for x in lines)
    assert not re.search(STAMP.replace("rank (\\d)", "rank 1") + "step", err1)  # rank 1: quiet
    said = "\n".join(lines)
    assert said.count("training on synthetic tokens") == 1
    assert said.count("checkpoints: none") == 1 and said.count(f"step log {logs}/log.jsonl") == 1

    rows = [json.loads(x) for x in (logs / "log.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("train", k) for k in range(1, STEPS + 1)]
    assert all(set(FIELDS) <= set(r) and "mfu" not in r for r in rows)
    assert [r["loss"] for r in rows] == summary["losses"]  # the very numbers of the summary
    assert rows[-1]["samples_per_s"] == pytest.approx(summary["samples_per_s"])
    seq = package[1]["model"]["inputs"]["input_ids"][0][1]
    assert all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * seq) for r in rows)
    assert [r["lr"] for r in rows] == [lr_at(k, LR, STEPS) for k in range(STEPS)]
    assert [r["grad_norm"] for r in rows] == pytest.approx(_norms(package[1]), rel=1e-4)

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs / "tensorboard" / "rank-0"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(summary["losses"])
    assert [e.step for e in events.Scalars("train/grad_norm")] == [1, 2, 3]


@pytest.mark.multiproc
@pytest.mark.slow
def test_quiet_run_with_named_logs(run_pipeline, package, tmp_path):
    """-q: no step lines (not even the bar), the logs it was asked for all written; W&B in
    offline mode where wandb is installed."""
    jsonl, board = tmp_path / "a" / "steps.jsonl", tmp_path / "tb"
    extra = ["-q", "--log-jsonl", str(jsonl), "--tensorboard", str(board)]
    has_wandb = importlib.util.find_spec("wandb") is not None
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    summary, ranks = _run(run_pipeline, package, tmp_path, "quiet",
                          [*extra, *(["--wandb", "ftpipe-test"] if has_wandb else [])], env)  # fmt: skip
    err0 = ranks.stderr(0)
    assert not re.search(r"step \d/|INFO", err0), err0
    assert "synthetic tokens" in err0  # a warning: -q keeps it
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [r["loss"] for r in rows] == summary["losses"]
    assert list((board / "rank-0").glob("events.out.tfevents.*"))
    assert list((board / "rank-1").glob("events.out.tfevents.*"))  # its memory
    if has_wandb:  # offline: the run on disk for `wandb sync`
        assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.parametrize(
    ("option", "module", "package"),
    [("tensorboard", "torch.utils.tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")],
)
def test_a_named_log_without_its_package_is_one_sentence(tmp_path, monkeypatch, option, module,
                                                         package):  # fmt: skip
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: import fails
    with pytest.raises(PipelineConfigError, match=f"--{option} needs the {package} package: "
                       f"pip install {package}"):  # fmt: skip
        RunLog(None, 0, **{option: str(tmp_path / "x")})


def test_help_names_the_package_and_every_default(package):
    """`python -m <pkg> --help`: the package's own name, every option with its help and its
    default (a flag's is off)."""
    import subprocess

    from ftpipe_runtime.job.options import _Help, parser

    pkg, plan, _ = package
    r = subprocess.run([sys.executable, "-m", pkg.name, "--help"], cwd=pkg.parent,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m {pkg.name} ") and "<package>" not in r.stdout
    assert f"torchrun --nproc_per_node 2 -m {pkg.name}" in r.stdout
    options = [a for a in parser(plan, pkg.name)._actions if a.option_strings != ["-h", "--help"]]
    assert len(options) > 40
    for action in options:
        assert action.help, action.option_strings
        assert any(o in r.stdout for o in action.option_strings), action.option_strings
        said = _Help("x")._get_help_string(action)
        assert "default" in said or action.nargs == 0, action.option_strings
