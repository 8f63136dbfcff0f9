"""The memory a run uses is what its plan says (issue 32): a Qwen2-shaped model whose tied
embedding (32,000 x 480, 61 MB) dominates, cut in two (the embedding on rank 0, the LM head
reading it on rank 1), trains 6 steps with an evaluation of 16 batches every 3 on 2 CPU ranks
under GPipe, PipeDream-2BW and FTPipe. Each rank's peak, as the runtime reports it (the resident set
grown since before its stages were built: `ftpipe_runtime.job.memory.Memory`), is within 15% of
the plan's figure for that rank (`ftpipe_compiler.costs.gpu_memory`, with the run's
--post-ahead), and the evaluation sends the embedding once per round.

It failed before: every evaluation batch cloned and sent the embedding (+656 MB a round on
each rank), and with glibc keeping the heap a rank grew step after step. Under 2BW rank 1 then
peaked at 234-273 MiB against 229.8 planned, over the 15% now and then: at its peak (the
step's last backward, when rank 0, ahead, has sent the next version) it holds the five
embedding-sized buffers the plan counts, and beside them the fused loss's chunk temporaries
(a 4 MB log-softmax, a 4 MB softmax a micro-batch) that glibc's heap, kept whole till the
step's end, did not reuse: 12-27 MB by chance of the layout. They go to a kept buffer now
(`fused_loss._chunk_buffer`): 238.7-244.1 MiB in 12 runs.

Under FTPipe rank 1 peaked at 270 MiB against 225.4 planned: the round after step 3 sent a
copy of the embedding (a clone on rank 0, a receive on rank 1) that rank 1 already held, the
version its next forward reads; now it reads that one (`Dataflow.eval_reads`). Under zb1p
(a split backward) rank 0 peaked at 1.19 x its plan and rank 1 at 1.28: W added each
gradient into `.grad` out of place (a third embedding-sized tensor beside the sum and the
new gradient), and each deferred W's graph kept its input's gradient (the embedding's, on
rank 1) after the B had added it into the sum; 1.03 and 1.08 now.

A T5 whose decoder stage reads the tied embedding twice (it embeds and predicts with it)
peaked at 1.24-1.42 x on rank 1: the plan counted one gradient of it at a time, the backward
holds two before adding them (`Stage.reread`), and the fused head's, in a pooled buffer,
made autograd's sum out of place (not pooled there now: `fused_loss.pooled_weight_gradients`).
Where the head's gradient was not pooled at all, the Qwen2 model's rank 1 fell to 0.85 x
under GPipe: the plan counted the next step's embedding posted ahead, which on a CPU takes
memory only when it lands, after the old one is let go (`MemoryView.lands_late`, under a
synchronous schedule; under FTPipe it lands before the peak or after, by timing); the
pool's idle buffers had filled that place, and beside an evaluation's copy of the weights
raised the peak (let go before an evaluation now: `release_idle_gradients`). Those figures
are of the model at 320 wide (41 MB embedding). At 480 wide one run measured 0.878-1.090
x the plan on every rank of these cases; at 640 wide, Qwen2 and T5 under gpipe, 1f1b and
2bw, 0.990-1.060. The least, gpipe-offload's rank 0 (0.88), was the plan counting a second
gradient sum on the host for the step's whole run, which only an asynchronous schedule's
backwards fill (`host_param_bytes(summed_apart=...)`): 0.99 without it. bf16 was not in these
cases: its rank 0 then measured 1.14 x once that sum was gone, the CPU's add of a bf16
gradient into its fp32 sum making an fp32 copy of the whole embedding's (added a chunk at a
time since: `precision.add_into`), and its rank 1 1.18, a process's ~16 MiB beyond its
tensors that the CPU's reserve did not count (`context_bytes` in configs/hardware/cpu.json
since). At 480 wide then, Qwen2 in fp32 and bf16, T5 in fp32, gpipe, 2bw and gpipe-offload:
0.945-1.058. One run of this file on two workers: every rank of every case 0.945-1.059 (zb1p,
back with its receives posted on demand: 0.958 and 1.015).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402
from ftpipe_compiler.costs.gpu_memory import gpu_memory  # noqa: E402
from ftpipe_compiler.costs.host import Offload  # noqa: E402
from ftpipe_compiler.plan import Plan  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

VOCAB, HIDDEN = 32_000, 480  # at 320 a rank's fixed ~20 MB (heap, libraries) was 14% of rank 1
EMBEDDING = VOCAB * HIDDEN * 4
POST_AHEAD_MB = 16  # one embedding-sized message posted ahead (the default would post several)


def _post_ahead_mb(schedule: str) -> int:
    """Under FTPipe and zb1p the next version posted ahead lands before rank 1's peak or after
    it, by the machine's timing (FTPipe's rank 1 at 0.85 or 1.02 x a plan counting it, 1.02
    or 1.22 x one that does not: `MemoryView.lands_late`; zb1p's at 0.81 x, or 1.09-1.15 x
    one that does not under CI's load, its split backward's last weight passes running while
    rank 0 steps): their receives are posted on demand here (zb1p then 1.02-1.04 loaded)."""
    return 0 if schedule in ("ftpipe", "zb1p") else POST_AHEAD_MB


EVAL_SAMPLES = 32  # 16 batches of tiny-lm's 2 sequences of 16 tokens


def _compiled(root, model, task, dtype="fp32"):
    """`model` saved under `root` and compiled for 2 CPU ranks (the layers cut evenly, GPipe);
    (the package folder, its plan, an evaluation file of 16 batches)."""
    model.save_pretrained(root / "model")
    out = root / "out"
    args = ["compile", "-m", str(root / "model"), "--task", task, "--gpus", "2", "--dtype", dtype]
    args += ["--hardware", "cpu", "--schedule", "gpipe", "-p", "even-layers", "-o", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    ids = torch.randint(0, VOCAB, (EVAL_SAMPLES, 16), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids, "labels": ids}, root / "val.pt")
    pkg = next(p for p in out.iterdir() if p.is_dir())
    return pkg, Plan.load(out / "plan.json"), root / "val.pt"


def _qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """(the package folder, its plan, the evaluation file): the Qwen2-shaped model."""
    pkg, plan, val = _compiled(tmp_path_factory.mktemp("tied"), _qwen(), "tiny-lm")
    tied = next(t for t in plan.transfers if t.tensor == "model.embed_tokens.weight")
    gpu = {s.id: s.gpu for s in plan.stages}
    assert (gpu[tied.producer], [gpu[c] for c in tied.consumers]) == (0, [1])
    return pkg, plan, val


@pytest.fixture(scope="module")
def package_bf16(tmp_path_factory):
    """The same model compiled for bf16 (16-bit weights, fp32 masters and sums)."""
    return _compiled(tmp_path_factory.mktemp("tied-bf16"), _qwen(), "tiny-lm", dtype="bf16")


def _offloaded(pkg, plan):
    """A copy of the package whose plan keeps stage 0's optimizer on the host (the planner's
    per-stage `offload`), and that plan: on a CPU rank the host copies are its memory too."""
    copy = pkg.parents[1] / "out-offloaded" / pkg.name  # as deep: its model found the same
    shutil.copytree(pkg, copy, dirs_exist_ok=True)
    d = json.loads((copy / "plan.json").read_text())
    d["stages"][0]["offload"] = {"optimizer": True, "activations": False}
    (copy / "plan.json").write_text(json.dumps(d))
    stages = tuple(replace(s, offload=Offload(optimizer=s.id == 0)) for s in plan.stages)
    return copy, plan.with_(stages=stages)


@pytest.mark.parametrize(
    "schedule",
    ["gpipe", "2bw", "ftpipe", "zb1p", "gpipe-offload", "ftpipe-offload", "gpipe-offload-bf16"],
)
def test_each_rank_peaks_within_15_percent_of_its_plan(
    run_pipeline, package, package_bf16, tmp_path, schedule
):
    """... under the default schedule (FTPipe's) too, and with stage 0's masters, AdamW state,
    gradient sums and landing buffers on the host (`gpipe-offload`: 20 B an element there
    against 12 beside the weights; `ftpipe-offload`: its CPU step beside the rank's actions,
    landed at the stage's next forward or recomputing backward, so no sum apart: 1.05 x on
    rank 0 on 2026-11-30, 0.945 x with one counted), and in bf16 (a 2-byte landing
    buffer and one to stage the new weights in, each gradient added into its fp32 sum with
    no fp32 copy of it)."""
    pkg, plan, val = package
    embedding = EMBEDDING
    if schedule.endswith("-bf16"):
        schedule = schedule.removesuffix("-bf16")
        (pkg, plan, val), embedding = package_bf16, EMBEDDING // 2
    if schedule.endswith("-offload"):
        schedule = schedule.removesuffix("-offload")
        pkg, plan = _offloaded(pkg, plan)
    summary, sent = _run(run_pipeline, pkg, val, tmp_path, schedule)
    # The embedding crosses once per evaluation round, beside the activations (they are small);
    # under FTPipe the round after step 3 reads the version rank 1 holds for its next forward
    # (its versions straddle the step): only the last round sends it.
    rounds = 1 if schedule == "ftpipe" else 2
    assert embedding * rounds <= sent[0]["eval"][1] < embedding * (rounds + 0.1)
    _within_15_percent(summary, replace(plan, schedule=schedule))


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """A T5 whose decoder stage (rank 1) reads the tied embedding twice: it embeds the
    decoder's inputs and predicts with it."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=32,
        d_ff=2 * HIDDEN,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        tie_word_embeddings=True,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    found = _compiled(
        tmp_path_factory.mktemp("t5"), T5ForConditionalGeneration(config), "tiny-seq2seq"
    )
    assert [s.reread for s in found[1].stages if s.gpu == 1] == [("shared.weight",)]
    return found


@pytest.mark.parametrize("schedule", ["gpipe", "2bw", "ftpipe"])
def test_a_stage_reading_the_weight_twice_keeps_the_promise(run_pipeline, t5, tmp_path, schedule):
    """It holds both the weight's gradients before adding them (`Stage.reread`). Rank 1
    peaked at 1.29 x its plan under GPipe, 1.24 under FTPipe and 1.42 under 2BW while the
    plan counted one, and the fused head kept its gradient of the received weight in a
    pooled buffer, so autograd made their sum beside them (`pooled_weight_gradients`)."""
    pkg, plan, val = t5
    summary, _ = _run(run_pipeline, pkg, val, tmp_path, schedule)
    _within_15_percent(summary, replace(plan, schedule=schedule))


def _run(run_pipeline, pkg, val, tmp_path, schedule):
    """6 steps on 2 CPU ranks, evaluated every 3: the --log-json summary, and what each rank
    sent ({rank: {kind: [messages, bytes]}})."""
    log, trace = tmp_path / "log.json", tmp_path / "trace.json"
    argv = ["--steps", "6", "--schedule", schedule, "--eval-data", str(val), "--eval-every", "3"]
    argv += ["--post-ahead", str(_post_ahead_mb(schedule)), "--device", "cpu"]
    argv += ["--log-json", str(log), "--trace", str(trace)]
    plan_json = json.loads((pkg / "plan.json").read_text())
    codes, ranks = run_pipeline(plan_json, argv, module=pkg.name, cwd=pkg.parent, timeout=600)
    assert codes == [0, 0], ranks.stderr()
    summary = json.loads(log.read_text())
    assert [e["step"] for e in summary["evals"]] == [3, 6]
    return summary, {r["rank"]: r["sent"] for r in json.loads(trace.read_text())["ranks"]}


def _within_15_percent(summary, planned) -> None:
    for rank, measured in enumerate(summary["memory_bytes"]):
        want = gpu_memory(planned, rank, post_ahead_bytes=_post_ahead_mb(planned.schedule) * 2**20)
        assert abs(measured / want.total - 1) <= 0.15, (
            f"rank {rank}: measured {measured / 2**20:.1f} MiB, planned "
            f"{want.total / 2**20:.1f} MiB ({want.to_json()})"
        )
