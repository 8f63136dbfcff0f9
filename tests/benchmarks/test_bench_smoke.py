"""The benchmark harness of BENCHMARKS.md sections 3-4, on tiny sizes (seconds).

The pieces a benchmark figure rests on, each against a reference: the hand-cut pipelining
stages against the HF model's own loss, the pipelining run against one process, the step
statistics and action summaries against hand computations.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.harness.actions import summarise
from benchmarks.harness.launch import flags, torchrun
from benchmarks.harness.reference import (
    Recomputed,
    build_model,
    lm_loss,
    split_stages,
    step_batch,
    train_single,
)
from benchmarks.harness.stats import OtherLoad, fmt_ratio, step_times, summarise_steps
from benchmarks.runtime.bench import blocks_on_first_stage

TINY_PLAN = {  # what the benchmark reads from a plan: the model's inputs, micro-batches
    "micro_batches": 2,
    "model": {
        "model_name": "gpt2-tiny",
        "head": "causal-lm",
        "vocab": {"vocab_size": 128},
        "micro_batch": 2,
        "inputs": {"input_ids": [[2, 16], "int64"], "labels": [[2, 16], "int64"]},
    },
}


def test_step_times_skip_warmup_and_cooldown():
    ends = [5.0, 7.0, 8.5, 10.5, 12.0, 20.0]  # the first and the last step are not timed
    times = step_times(ends, warmup=1, cooldown=1)
    assert times == [2.0, 1.5, 2.0, 1.5]
    s = summarise_steps(times, samples_per_step=8)
    assert s["step_s"] == pytest.approx(1.75)
    assert s["step_std_s"] == pytest.approx(statistics.stdev(times))
    assert s["samples_per_s"] == pytest.approx(8 / 1.75)
    with pytest.raises(ValueError):
        step_times(ends, warmup=0)


def test_fmt_ratio_combines_both_standard_errors():
    a = {"samples_per_s": 4.0, "step_s": 2.0, "step_std_s": 0.2, "timed_steps": 4}
    b = {"samples_per_s": 2.0, "step_s": 4.0, "step_std_s": 0.4, "timed_steps": 4}
    se = 2.0 * ((0.1**2 / 4) * 2) ** 0.5  # ratio x sqrt(sum of (cv^2 / n))
    assert fmt_ratio(a, b) == f"2.00 ± {se:.2f}"


def test_other_load_is_cpu_time_not_ours(monkeypatch):
    from benchmarks.harness import stats as bench_stats

    # Readings at the start and at the end, in seconds: wall clock, all CPU, our CPU.
    for name, values in (("_busy_s", [10.0, 13.0]), ("_ours_s", [1.0, 3.0])):
        monkeypatch.setattr(bench_stats, name, iter(values).__next__)
    monkeypatch.setattr(bench_stats.time, "perf_counter", iter([0.0, 2.0]).__next__)
    with OtherLoad() as load:
        pass
    assert load.cores == pytest.approx((13 - 10 - (3 - 1)) / 2)  # 1 s of others' CPU in 2 s


def test_flags():
    assert flags(schedule="1f1b", force=True, cache=False, seq_len=None, micro_batches=4) == [
        "--schedule", "1f1b", "--force", "--no-cache", "--micro-batches", "4",
    ]  # fmt: skip


def test_split_stages_reproduce_the_models_loss_and_gradients(seed):
    model = build_model("gpt2-tiny", seed=seed)
    ids = torch.randint(0, 128, (2, 16))
    expected = model(input_ids=ids, labels=ids, use_cache=False).loss  # HF's own loss
    expected.backward()
    want = model.transformer.h[0].attn.c_attn.weight.grad.clone()
    model.zero_grad()
    first, last = split_stages(model, blocks=1)
    got = lm_loss(Recomputed(last)(Recomputed(first)(ids)), ids)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(model.transformer.h[0].attn.c_attn.weight.grad, want, atol=1e-6)


def test_blocks_on_first_stage():
    def stage(i, blocks):
        return {"id": i, "params": [f"transformer.h.{b}.mlp.c_fc.weight" for b in blocks]}

    assert blocks_on_first_stage({"stages": [stage(0, [0, 1, 2]), stage(1, [3, 4])]}) == 3
    with pytest.raises(ValueError):
        blocks_on_first_stage({"stages": [stage(0, [0, 2]), stage(1, [1, 3])]})


def test_every_runtime_run_times_the_same_steps_and_only_an_async_one_trains_a_tail(
    tmp_path, monkeypatch
):
    from benchmarks.runtime import bench as runtime_bench

    bench = runtime_bench.Bench(tmp_path, micro_batches=4, micro_batch=2, timed=3)
    assert bench.timed == range(runtime_bench.WARMUP, runtime_bench.WARMUP + 3)
    steps = {who: bench.steps(w) for who, w in runtime_bench.WINDOWS.items()}
    assert steps == {"ftpipe": 5, "ftpipe, asynchronous": 6, "pipelining": 5, "single": 5}
    argvs = []

    def run_package(out, package, argv, result, actions):
        argvs.append(argv)
        return {"segments": []}

    monkeypatch.setattr(runtime_bench, "run_package", run_package)
    compiled = {"output": str(tmp_path), "package": "p"}
    for schedule in ("gpipe", "1f1b", "zbv", "ftpipe"):
        bench.ftpipe(compiled, schedule, schedule)
    assert [int(a[a.index("--steps") + 1]) for a in argvs] == [5, 5, 5, 6]


def test_summarise_excludes_warmup_and_waits():
    rows = [  # kind, stage, mb, start, end, waited; 2 micro-batches a step
        ("F", 0, 0, 0.0, 1.0, 0.0),  # step 0: warm-up
        ("F", 0, 2, 0.0, 0.5, 0.1),
        ("F", 0, 3, 1.0, 1.3, 0.0),
        ("B", 0, 2, 2.0, 3.0, 0.4),
        ("S", 0, 1, 3.0, 3.2, 0.0),
    ]
    out = summarise(rows, micro_batches=2, timed=range(1, 2))["0"]
    assert out["F"]["count"] == 2
    assert out["F"]["compute_s"] == pytest.approx((0.4 + 0.3) / 2)
    assert out["F"]["wait_s"] == pytest.approx(0.05)
    assert out["B"]["compute_per_step_s"] == pytest.approx(0.6)
    assert out["S"]["compute_s"] == pytest.approx(0.2)
    assert "cpu_s" not in out["F"]  # format 1 rows: no usage to average


def test_summarise_averages_cpu_and_faults_of_format_2_rows():
    rows = [("F", 0, 2, 0.0, 0.5, 0.1, 0.3, 100), ("F", 0, 3, 1.0, 1.3, 0.0, 0.2, 300)]
    out = summarise(rows, micro_batches=2, timed=range(1, 2))["0"]["F"]
    assert out["cpu_s"] == pytest.approx(0.25) and out["faults"] == pytest.approx(200)
    assert "sys_s" not in out  # format 2: no kernel share


def test_summarise_averages_the_kernel_time_of_format_3_rows():
    rows = [("F", 0, 2, 0.0, 0.5, 0.1, 0.3, 100, 0.1), ("F", 0, 3, 1.0, 1.3, 0.0, 0.2, 300, 0.0)]
    out = summarise(rows, micro_batches=2, timed=range(1, 2))["0"]["F"]
    assert out["sys_s"] == pytest.approx(0.05) and out["cpu_s"] == pytest.approx(0.25)


def test_pipelining_runs_start_at_the_single_process_loss(tmp_path, seed):
    """Two gloo ranks of torch.distributed.pipelining against one process: the same loss at
    step 1, then apart (its LM head and embedding are no longer one parameter); two
    configurations in one launch, each from the weights file afresh."""
    plan, weights = tmp_path / "plan.json", tmp_path / "w.pt"
    plan.write_text(json.dumps(TINY_PLAN))
    torch.save(build_model("gpt2-tiny", seed).state_dict(), weights)
    runs = [
        {"plan": str(plan), "blocks": 1, "schedule": s, "recompute": r,
         "result": str(tmp_path / f"{s}-{r}.json")}
        for s, r in (("1f1b", False), ("gpipe", True))
    ]  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    args = ["-m", "benchmarks.harness.pipelining_worker", "--runs", tmp_path / "runs.json"]
    torchrun(args + flags(weights=weights, steps=2, lr=1e-2), tmp_path / "pipelining.log")
    single = train_single(TINY_PLAN, str(weights), steps=2, lr=1e-2, seed=0)
    for run in runs:
        piped = json.loads(Path(run["result"]).read_text())
        assert piped["schedule"] == run["schedule"]
        assert piped["losses"][0] == pytest.approx(single["losses"][0], rel=1e-6)
        assert abs(piped["losses"][1] - single["losses"][1]) > 1e-5
        assert len(piped["step_ends_s"]) == 2


def test_torchrun_gives_each_rank_torchruns_environment(tmp_path):
    # One write per rank: the ranks share one stdout file, and print(*values) unbuffered
    # writes each value and space apart, which a busy machine interleaves between ranks.
    show = "import os, sys; sys.stdout.write(' '.join(os.environ[k] for k in ('RANK', "
    show += "'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', "
    show += "'OMP_NUM_THREADS')) + '\\n')"
    out = torchrun(["-c", show], tmp_path / "env.log", nproc=3)
    rows = sorted(line.split() for line in out.splitlines())
    assert [r[:4] for r in rows] == [[str(r), str(r), "3", "3"] for r in range(3)]
    assert {tuple(r[4:]) for r in rows} == {("127.0.0.1", rows[0][5], "1")}


def test_torchrun_stops_the_others_when_a_rank_fails_and_shows_its_tail(tmp_path):
    fail = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('rank one broke')\n"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1 .*failed \\(1\\).*rank one broke"):
        torchrun(["-c", fail + "time.sleep(120)"], tmp_path / "fail.log")
    assert time.monotonic() - t0 < 60  # rank 0 was stopped, not waited for
    assert "rank one broke" in (tmp_path / "fail.log").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun(["-c", "import time; time.sleep(120)"], tmp_path / "slow.log", timeout=1)


def test_step_batch_stacks_the_runtimes_micro_batches():
    from ftpipe_runtime.data.batches import make_data

    data = make_data(TINY_PLAN["model"], None, 0)
    ids, labels = step_batch(data, step=1, micro_batches=2)
    assert torch.equal(ids[2:], data.get("input_ids", 3))
    assert torch.equal(labels, ids)  # GPT-2: the labels are the inputs


def _run(rate: float, losses=(10.0, 9.0), actions=None) -> dict:
    step = 8 / rate
    stats = summarise_steps([step * 0.99, step * 1.01], samples_per_step=8)
    return {**stats, "losses": list(losses), "actions": actions, "other_cores": [0.0, 0.0],
            "same_losses_every_round": True}  # fmt: skip


def _runtime_data() -> dict:
    stage = {"nodes": 10, "fwd_s": 0.1, "bwd_s": 0.2, "recompute_s": 0.1}
    acts = {k: {"compute_s": 0.1, "wait_s": 0.05, "count": 4, "compute_per_step_s": 0.4}
            for k in "FBS"}  # fmt: skip
    names = ["ftpipe-even-gpipe", "ftpipe-even-1f1b", "pipelining-gpipe", "pipelining-1f1b",
             "pipelining-gpipe-tuned", "pipelining-1f1b-tuned", "ftpipe-plan-gpipe",
             "ftpipe-plan-1f1b", "ftpipe-plan-ftpipe", "single"]  # fmt: skip
    runs = {n: _run(2.0, actions={"0": acts, "1": acts}) for n in names}
    runs["ftpipe-even-1f1b"] = _run(1.0, actions={"0": acts, "1": acts})  # half pipelining's
    runs["pipelining-1f1b"]["losses"] = [10.0, 9.5]  # drifts by 0.5 at step 2
    tied = {"tensor": "w", "bytes": 51_000_000, "weight": True}
    plan = {"partitioner": "gpipe", "simulated_step_s": 2.0, "transfers": [tied],
            "stages": [{**stage, "stage": 0, "gpu": 0, "blocks": [0, 1]},
                       {**stage, "stage": 1, "gpu": 1, "blocks": [2, 3]}]}  # fmt: skip
    best = {**plan, "partitioner": "mixed", "lower_bound_s": 0.1,
            "competitors": {"gpipe": 2.0, "mixed": 1.0}}  # fmt: skip
    return {"model": "gpt2-bench", "batch": 8, "seq_len": 128, "micro_batches": 4, "lr": 1e-4,
            "warmup_steps": 1, "timed_steps": 1, "cooldown_steps": 1, "rounds": 2,
            "even_blocks": 2, "plans": {"even": plan, "ftpipe": best}, "runs": runs}  # fmt: skip


def test_runtime_markdown_computes_its_ratios_and_drift():
    from benchmarks.runtime.report import markdown

    text = markdown(_runtime_data())
    assert "| 1F1B | 1.00 ± 0.01 | 2.00 ± 0.03 | 0.50 ± 0.01 |" in text  # ftpipe / pipelining
    assert "max Δ 5.0e-01" in text  # pipelining's drift from the single process
    assert "slower than pipelining here (down to 0.500x" in text
    assert "w (51.00 MB, once per step)" in text and "A tied weight travels" in text
    assert "simulated plan / even" in text and "| 2.00 |" in text  # 2.0 s / 1.0 s simulated


def test_fidelity_runs_every_package_once_a_round(monkeypatch, tmp_path):
    """The runs go in rounds (a, b, c, a, b, c...), each case's row made after its last."""
    from benchmarks.fidelity import bench as fidelity

    order = []
    monkeypatch.setattr(fidelity, "measure_link", lambda work: {"sizes": [1], "one_way_s": [1]})
    monkeypatch.setattr(fidelity, "fit", lambda points, times: (0.0, 1.0))
    monkeypatch.setattr(fidelity, "CASES", {"a": None, "b": None})
    monkeypatch.setattr(fidelity, "prepare_case", lambda name, *a: SimpleNamespace(name=name))
    monkeypatch.setattr(fidelity, "run_once", lambda p, work, warmup: order.append(p.name))
    monkeypatch.setattr(fidelity, "finish_case", lambda p, *a: {
        "name": p.name, "simulated_step_s": 1.0, "measured": {"step_s": 1.0, "runs_step_s": []}})  # fmt: skip
    data = fidelity.measure(tmp_path, cases=("a", "b"), reports=tmp_path, runs=3)
    assert order == ["a", "b"] * 3
    assert [c["name"] for c in data["cases"]] == ["a", "b"] and data["runs"] == 3


def test_fidelity_markdown_flags_errors_beyond_the_target():
    from benchmarks.fidelity.report import markdown

    prof = {"gpu": 0, "fwd_s": 0.1, "bwd_s": 0.2, "recompute_s": 0.1, "recompute": False,
            "step_s": 0.1}  # fmt: skip
    acts = {k: {"compute_s": 0.1, "wait_s": 0.0, "count": 4, "compute_per_step_s": 0.4,
                "wait_per_step_s": 0.0} for k in "FBS"}  # fmt: skip
    case = {"busy_fraction": [0.8], "label": "p", "name": "p", "stages": [[0, 0]],
            "micro_batches": 4, "file_bandwidth": 5e9, "file_latency_s": 5e-5,
            "simulated_step_s": 1.0, "simulated_step_s_link_now": 1.0,
            "timelines": "out/p.compare.html",
            "measured": {**summarise_steps([1.5, 1.5], 8), "other_cores": 0.0},
            "error": -1 / 3, "profile": {"0": prof},
            "actions": {"0": acts}}  # fmt: skip
    link = {"sizes": [4096, 51_463_168], "bandwidth_by_size": [1e6, 2e9], "latency_s": 1e-4,
            "bandwidth": 2e9, "link_latency_s": 1e-4, "link_bandwidth": 2e9}  # fmt: skip
    text = markdown({"model": "m", "warmup_steps": 1, "timed_steps": 2, "link": link,
                     "cases": [case]})  # fmt: skip
    assert "-33.3% ✗" in text and "0 of 1 plans within ±10%" in text
    # busiest rank, simulated / measured: compute 0.8 x 1 s / F + B; the step model's and
    # the step actions; waits (the simulator's idle time less its steps)
    assert "| p | 0 | 800 / 800 | 100 / 400 | 100 / 0 | 300 | 1000 / 1500 |" in text
    assert "largest part of the -33.3% is the optimizer-step actions (300 ms" in text
    assert "50 us + bytes / 5.00 GB/s" in text and "[p](out/p.compare.html)" in text
    assert "| 0 | 0 | 100 | 100 | 200 | 100 | 100 | 100 |" in text  # no kernel times: format 2
    acts["B"]["sys_s"] = 0.03  # format 3 traces: the kernel's part of the action, in brackets
    text = markdown({"model": "m", "warmup_steps": 1, "timed_steps": 2, "link": link,
                     "cases": [case]})  # fmt: skip
    assert "| 0 | 0 | 100 | 100 | 200 | 100 (30) | 100 | 100 |" in text
    assert "rank 0's thread spent 120 ms of each step in the kernel" in text  # 4 B x 30 ms
    assert "rounds" not in text  # one run: no range
    case["measured"]["runs_step_s"] = [1.5, 1.2, 1.65]  # three runs: the median one above
    text = markdown({"model": "m", "warmup_steps": 1, "timed_steps": 2, "link": link,
                     "cases": [case], "runs": 3})  # fmt: skip
    assert "| 1.500 ± 0.000 (1.200–1.650) | -33.3% ✗ |" in text
    assert "ran 3 times, in 3 rounds of every package once" in text
    assert "differed by up to 38% in mean step (p)" in text


def test_schedules_section_on_a_tiny_model():
    """The side-by-side section end to end on GPT-2 tiny over 2 GPUs: every schedule gets a
    plan, WPipe's is looped, and the comparison with the paper is written."""
    from benchmarks.schedules import bench as bench_schedules
    from benchmarks.schedules import markdown

    data = bench_schedules.measure([("gpt2-tiny", None, "rtx2080ti", 2)], steps=4)
    rows = data["cases"][0]["rows"]
    assert list(rows) == list(bench_schedules.SCHEDULES)
    assert all(r["best"] and r["best"]["fits"] for r in rows.values())
    assert rows["wpipe"]["best"]["stages"] == 4
    two_bw, wpipe = rows["2bw"]["best"]["memory"], rows["wpipe"]["best"]["memory"]
    assert two_bw["extra"] > wpipe["extra"] > 0 and rows["gpipe"]["best"]["memory"]["extra"] == 0
    text = markdown(data)
    assert "| wpipe | " in text and "WPipe vs 2BW (both cut by pipedream)" in text
    assert "(paper 1.4x)" in text and "(paper -36%)" in text


def test_startup_rows_take_the_least_disturbed_wall_time_and_say_the_verdict():
    import os
    import resource

    from benchmarks.startup import bench as bench_startup

    tries = {
        "10": [{"seconds": s, "cpu_s": [c, 1.0], "peak_mib": [300, 301]} for s, c in
               [(9.0, 2.0), (7.0, 2.5), (8.0, 2.2)]],
        "100000": [{"seconds": s, "cpu_s": [c, 1.0], "peak_mib": [302, 300]} for s, c in
                   [(8.5, 2.4), (10.0, 2.6), (11.0, 2.3)]],
    }  # fmt: skip
    row = bench_startup._row("ftpipe", tries)
    assert row["extra_s"] == pytest.approx(8.5 - 7.0)
    assert row["extra_cpu_s"] == pytest.approx(2.4 - 2.2)
    assert row["100000"]["peak_mib"] == 302
    data = {"model": "m", "gpus": 2, "rounds": 3, "steps": [10, 100000], "target_s": 2.0}
    text = bench_startup.markdown({**data, "rows": [row], "met": True, "other_load_cores": 0.1})
    assert "| ftpipe | 7.00 | 8.50 | +1.50 | 2.20 | 2.40 | +0.20 | 301 | 302 |" in text
    assert "Target met for every schedule." in text
    assert sum(i * i for i in range(300_000))  # some CPU time of our own
    used = resource.getrusage(resource.RUSAGE_SELF)
    assert bench_startup._cpu_s(os.getpid()) == pytest.approx(
        used.ru_utime + used.ru_stime, abs=0.2
    )


def test_calibration_fits_latency_and_bandwidth_and_counts_the_cache():
    from benchmarks.calibrate import fit, last_level_cache_bytes

    sizes = [4096, 262_144, 4_194_304, 51_463_168]
    latency, bandwidth = fit([(1, n) for n in sizes], [5e-5 + n / 2e9 for n in sizes])
    assert latency == pytest.approx(5e-5) and bandwidth == pytest.approx(2e9)
    # A ring all-reduce over d ranks: 2(d-1) latencies, 2(d-1)/d of the bytes per link.
    rows = [(2 * (d - 1), 2 * (d - 1) / d * n) for d in (2, 4) for n in sizes]
    latency, bandwidth = fit(rows, [k * 1e-4 + b / 3e9 for k, b in rows])
    assert latency == pytest.approx(1e-4) and bandwidth == pytest.approx(3e9)
    # Small messages faster than the line through the large ones: the unconstrained fit's
    # latency is negative; then latency 0 and the bandwidth that best fits alone.
    times = [1e-6, 1.05e-4, 4_194_304 / 2e9, 51_463_168 / 2e9]
    latency, bandwidth = fit([(1, n) for n in sizes], times)
    ratios = [n / t for n, t in zip(sizes, times)]  # relative error: minimise sum (r/b - 1)^2
    assert latency == 0.0
    assert bandwidth == pytest.approx(sum(r * r for r in ratios) / sum(ratios))
    assert last_level_cache_bytes() >= 0


def test_16_bit_peaks_are_fp32_peak_scaled_by_the_measured_matmul_times():
    from benchmarks.calibrate import sixteen_bit_flags, sixteen_bit_peaks

    times = {"float32_s": 0.1, "bfloat16_s": 7.0, "float16_s": 0.05}  # slower; twice as fast
    peaks = sixteen_bit_peaks(50e9, times)
    assert peaks == {"bfloat16": float(f"{50e9 / 70:.3g}"), "float16": 1e11}
    assert all("16" in flag for flag in sixteen_bit_flags())


def test_a_timed_parts_set_up_is_made_once_and_taken_once(tmp_path):
    from benchmarks.harness.set_up import prepare, take

    calls = []

    def make(work):
        calls.append(work)
        (work / "pkg").write_text("compiled")
        return {"package": str(work / "pkg")}

    work = tmp_path / "section"
    assert prepare(work, make) == {"package": str(work / "pkg")}
    assert take(work, make) == {"package": str(work / "pkg")} and len(calls) == 1
    assert take(work, make) == {"package": str(work / "pkg")} and len(calls) == 2  # no note


def test_sections_run_compute_parts_two_at_a_time_and_timed_parts_alone():
    from functools import partial

    from benchmarks.sections import Section, run_sections

    sections = {  # dict(...) is picklable: the compute-only parts run in child processes
        "both": Section(
            str, {"sim": (partial(dict, v=1), False), "run": (partial(dict, v=2), True)}
        ),
        "one": Section(str, {"": (partial(dict, v=3), False)}),
        "merged": Section(
            str, {"a": (partial(dict, v=4), True)}, combine=lambda r: {**r["a"], "w": 5}
        ),
    }
    out = run_sections(list(sections), sections, previous={"one": {"part_seconds": {"": 9.0}}})
    assert {k: v for k, v in out["both"].items() if k in ("sim", "run")} == {
        "sim": {"v": 1},
        "run": {"v": 2},
    }
    assert out["one"]["v"] == 3 and out["merged"]["v"] == 4 and out["merged"]["w"] == 5
    assert set(out["both"]["part_seconds"]) == {"sim", "run"}
    assert out["both"]["bench_seconds"] == pytest.approx(sum(out["both"]["part_seconds"].values()))


def test_ungroup_gives_each_configuration_of_a_shared_launch_its_own_results():
    from benchmarks.runtime.bench import ungroup

    raw = {
        "ftpipe": [{"losses": [1.0], "other_cores": 0.1}],
        "pipelining": [
            {"group": {"a": {"losses": [2.0]}, "b": {"losses": [3.0]}}, "other_cores": 0.2}
        ],
    }
    assert ungroup(raw) == {
        "ftpipe": [{"losses": [1.0], "other_cores": 0.1}],
        "a": [{"losses": [2.0], "other_cores": 0.2}],
        "b": [{"losses": [3.0], "other_cores": 0.2}],
    }


def test_memory_rows_say_planned_against_measured_and_the_verdict():
    from benchmarks.memory import bench as bench_memory

    gib = 2**30
    parts = {"stages": 5 * gib, "posted": gib // 2, "reserve": gib // 4, "replicas": 0}
    row = {"schedule": "gpipe", "dtype": "bf16", "rank": 0, "planned_bytes": 6 * gib, "measured_bytes": 5.7 * gib,
           "resident_bytes": 6.2 * gib, "parts": {**parts, "total": 6 * gib}, "ratio": 0.95}  # fmt: skip
    data = {"model": "m", "parameters": 494_032_768, "shards": 5, "gpus": 2, "steps": 6,
            "eval_every": 3, "seq_len": 128, "micro_batches": 2, "target": 0.15}  # fmt: skip
    text = bench_memory.markdown({**data, "rows": [row], "met": True})
    assert (
        "| gpipe | bf16 | 0 | 6.00 | 5.70 | 0.950 | 6.20 | stages 5.00, posted 0.50, reserve 0.25 |"
        in text
    )
    assert (
        "494 M parameters, 5 bf16 safetensors shards" in text
        and "Target met on every rank." in text
    )
    off = {"same_losses_as": "2bw", "same_losses": True,
           "per_step_s": [{"cpu_step": 1.0, "step_wait": 0.1}, {"cpu_step": 0.5, "step_wait": 0.0}]}  # fmt: skip
    said = (
        "With the optimizer offloaded (2bw-offload): losses the same bit for bit as 2bw's "
        "without; rank 0: the CPU step 1.00 s a step on the step thread, the rank waited 0.10 s "
        "for it (90% overlapped); rank 1: the CPU step 0.50 s a step on the step thread, the "
        "rank waited 0.00 s for it (100% overlapped)."
    )
    other = {**off, "same_losses_as": "ftpipe", "same_losses": False}
    text = bench_memory.markdown({**data, "rows": [row], "met": True, "offloaded": [off, other]})
    assert said in text and "(ftpipe-offload): losses DIFFERENT as ftpipe's without" in text
    old = bench_memory.markdown({**data, "rows": [row], "met": True, "offloaded": off})
    assert said in old  # BENCHMARKS.json's one case, before 2026-11-30
