"""BENCHMARKS.md section 4: does the simulator predict the generated package's step time?

    data = measure()            # ~3 min on 2 cores
    print(markdown(data))

For each plan of the GPT-2 bench model: compile it with a measured profile taken on one
thread (`--profile measured --hardware cpu`, the compile runs with OMP_NUM_THREADS=1), so the
profile times what a one-thread rank does, profiled afresh in this run (a private cache: a
profile cached under other conditions would not be this run's machine); simulate it under its
schedule with the hardware file's point-to-point link and optimizer step, calibrated once
for this machine (benchmarks/calibrate.py), and beside that with the link measured now
(`bench_gloo`); train the package on 2 one-thread ranks; compare the steady-state step
times. Each plan's simulated and measured timelines are drawn one above the other, on one
time scale, in an HTML report (`ftpipe simulate PLAN --compare TRACE --report`) written to
`REPORTS` (docs/fidelity/, which BENCHMARKS.md links to).

Each package is trained `RUNS` times and compared by its median run: on this shared VM the
same package's mean step moved 1.19-1.34 s from one run to the next (the critical rank's
forward 123 ms in one run, 139 ms in the next), as large as the errors the section looks for.
The runs go in rounds, each round every package once, so a stretch of minutes when the
machine is slower falls on every package alike instead of on one package's runs (a bias
then shows in every round, noise in one). The runs' range is reported beside it.

Beside each prediction, to show where a gap comes from: how long every action of the median
run took, waits for messages apart (`bench_actions`), against the profile's stage times.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftpipe_runtime.engine.trace import read_trace
from ftpipe_runtime.schedules import get_schedule
from tqdm import tqdm

from benchmarks.calibrate import fit
from benchmarks.fidelity.report import markdown  # noqa: F401 - the section's renderer
from benchmarks.harness.actions import load_actions, summarise
from benchmarks.harness.gloo import measure_link
from benchmarks.harness.launch import ROOT, compile_plan, run_child, run_package
from benchmarks.harness.probe import machine_seconds
from benchmarks.harness.stats import OtherLoad, step_times, summarise_steps
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.simulate import simulate
from ftpipe_compiler.simulate.measured import measured
from ftpipe_compiler.simulate.report import write_report

ALONE = True  # it times processes: the machine to itself (benchmarks.sections)

MODEL = "gpt2-bench"
WARMUP, TIMED, COOLDOWN = 2, 3, 1  # steps: set-up (the 2nd is still slow), timed, shutdown
RUNS = 3  # of each package, one a round: the median one is compared
SIM_STEPS = 10
REPORTS = ROOT / "docs" / "fidelity"  # each plan's simulated and measured timelines


def _handmade(out: Path, schedule: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.fidelity.handmade_plan", "-o", str(out)]
    text = run_child(cmd + ["--schedule", schedule], out.with_name(out.name + ".log"))
    return json.loads(text[text.index("{") :])


@dataclass(frozen=True)
class Case:
    label: str
    schedule: str
    build: object  # (output folder, schedule) -> the compile JSON

    def compile(self, out: Path) -> dict:
        return self.build(out, self.schedule)


CASES = {
    "even-gpipe": Case(
        "even split (4 + 4 blocks), GPipe",
        "gpipe",
        lambda out, s: compile_plan(
            out,
            MODEL,
            2,
            partitioners="even-layers",
            schedule=s,
            hardware="cpu",
            profile="measured",
        ),
    ),
    "winner-ftpipe": Case(
        "`ftpipe compile` winner, FTPipe async",
        "ftpipe",
        lambda out, s: compile_plan(out, MODEL, 2, schedule=s, hardware="cpu", profile="measured"),
    ),
    "three-stages-1f1b": Case("3 stages on 2 ranks (by hand: 0 → 1 → 0), 1F1B", "1f1b", _handmade),
}


@dataclass
class PreparedCase:
    """A case compiled and simulated, its runs to come (`run_once`, one a round)."""

    name: str
    case: Case
    info: dict
    plan: Plan
    staged: Plan
    at_profile: float
    argv: list
    samples: int
    runs: list = field(default_factory=list)  # (stats, the run's summary)
    probes: list = field(default_factory=list)  # machine_seconds() after each run


def prepare_case(name: str, case: Case, work: Path, warmup: int, timed: int) -> PreparedCase:
    info = case.compile(work / name)
    at_profile = machine_seconds()  # the compile just profiled the plan's ops
    out = Path(info["output"])
    # The plan as compiled: each stage's times its ops' profile summed, what `ftpipe compile`
    # simulates to choose plans. Beside it, each stage timed as one block (stage_times.py).
    plan = Plan.load(out / "plan.json")
    staged = with_stage_times(plan, out / "plan.json", work / f"{name}.stages.log")
    argv = ["--steps", str(warmup + timed + COOLDOWN), "--schedule", case.schedule]
    samples = plan.micro_batches * int(plan.model.get("micro_batch", 1))
    return PreparedCase(name, case, info, plan, staged, at_profile, argv, samples)


def run_once(p: PreparedCase, work: Path, warmup: int) -> None:
    """One training run of the case's package (`p.runs` grows by one)."""
    out, k = Path(p.info["output"]), len(p.runs)
    with OtherLoad() as load:
        result = run_package(
            out, Path(p.info["package"]).name, p.argv, work / f"{p.name}.run{k}.json",
            actions=True,
        )  # fmt: skip
    stats = summarise_steps(step_times(result["step_ends_s"], warmup, COOLDOWN), p.samples)
    p.runs.append(({**stats, "other_cores": load.cores}, result))
    p.probes.append(machine_seconds())


def finish_case(p: PreparedCase, link: dict, warmup: int, timed: int, reports: Path) -> dict:
    """The case's row: its simulations against its median run."""
    name, case, plan, staged, runs = p.name, p.case, p.plan, p.staged, p.runs
    policies = get_schedule(case.schedule).policies(plan.stage_infos(), plan.micro_batches)
    sim = simulate(plan, case.schedule, steps=SIM_STEPS)
    sim_staged = simulate(staged, case.schedule, steps=SIM_STEPS)
    now = plan.with_(bandwidth=link["link_bandwidth"], latency_s=link["link_latency_s"])
    sim_now = simulate(now, case.schedule, steps=SIM_STEPS)
    at_profile, at_run = p.at_profile, sum(p.probes) / len(p.probes)
    stats, result = sorted(runs, key=lambda r: r[0]["step_s"])[len(runs) // 2]
    stats["runs_step_s"] = [r[0]["step_s"] for r in runs]
    actions, report = None, None
    if "action_files" in result:
        rows = load_actions(result["action_files"])
        actions = summarise(rows, plan.micro_batches, range(warmup, warmup + timed))
        report = reports / f"{name}.html"  # the two timelines side by side
        run = measured(read_trace(result["action_files"][0]), plan.gpus)
        command = f"ftpipe simulate plan.json --compare trace.json --report {report.name}"
        write_report(report, plan, sim, command, run)
    return {
        "name": name,
        "label": case.label,
        "schedule": case.schedule,
        "partitioner": plan.partitioner,
        "stages": [[s.id, s.gpu] for s in plan.stages],
        "micro_batches": plan.micro_batches,
        "simulated_step_s": sim.step_time_s,
        "simulated_step_s_stages": sim_staged.step_time_s,
        "file_bandwidth": plan.bandwidth,
        "file_latency_s": plan.latency_s,
        "simulated_step_s_link_now": sim_now.step_time_s,
        "timelines": _shown(report) if report else None,
        "bytes_sent_per_step": [g.bytes_sent for g in sim.gpus],
        "busy_fraction": [g.busy_fraction for g in sim.gpus],
        "profile": {
            str(s.id): {
                "gpu": s.gpu,
                "fwd_s": s.fwd_s,
                "bwd_s": s.bwd_s,
                "recompute_s": s.recompute_s,
                "recompute": policies[s.id].recompute,
                "step_s": s.step_s,
            }
            for s in plan.stages
        },
        "actions": actions,
        "measured": stats,
        "error": (sim.step_time_s - stats["step_s"]) / stats["step_s"],
        # The same fixed work's seconds right after the profile and around the run: how
        # much slower the machine itself was while the run went (benchmarks/harness/probe.py).
        "machine_s": {"profile": at_profile, "run": at_run},
    }


def with_stage_times(plan: Plan, path: Path, log: Path) -> Plan:
    """`plan` with each stage's times measured on the stage as a whole, in a one-thread
    child like the ranks (benchmarks/fidelity/stage_times.py), instead of its ops' profile
    summed."""
    cmd = [sys.executable, "-m", "benchmarks.fidelity.stage_times", str(path)]
    text = run_child(cmd, log)
    timed = json.loads(text[text.index("{") :])
    return plan.with_(stages=tuple(replace(s, **timed[str(s.id)]) for s in plan.stages))


def _shown(path: Path) -> str:
    """The path BENCHMARKS.md (at the repository's root) links to."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def measure(
    work: Path | None = None,
    warmup: int = WARMUP,
    timed: int = TIMED,
    cases=tuple(CASES),
    reports: Path = REPORTS,
    runs: int = RUNS,
) -> dict:
    work = Path(work or ROOT / "out" / "bench" / "fidelity")
    work.mkdir(parents=True, exist_ok=True)
    reports.mkdir(parents=True, exist_ok=True)
    profiles = work / "profiles"  # profiled afresh, once, for every plan of this run
    shutil.rmtree(profiles, ignore_errors=True)
    os.environ["FTPIPE_CACHE_DIR"] = str(profiles)
    link = measure_link(work)
    link["link_latency_s"], link["link_bandwidth"] = fit(
        [(1, n) for n in link["sizes"]], link["one_way_s"]
    )
    prepared = [prepare_case(n, CASES[n], work, warmup, timed) for n in cases]
    for _ in tqdm(range(runs), desc="fidelity rounds", file=sys.stderr, disable=None):
        for p in prepared:  # every package once a round
            run_once(p, work, warmup)
    rows = []
    for p in prepared:
        rows.append(finish_case(p, link, warmup, timed, reports))
        tqdm.write(
            f"  {p.name}: simulated {rows[-1]['simulated_step_s']:.3f} s, measured "
            f"{rows[-1]['measured']['step_s']:.3f} s (runs {rows[-1]['measured']['runs_step_s']})",
            file=sys.stderr,
        )
    return {
        "model": MODEL,
        "warmup_steps": warmup,
        "timed_steps": timed,
        "runs": runs,
        "link": link,
        "cases": rows,
    }


if __name__ == "__main__":
    print(markdown(measure()))
