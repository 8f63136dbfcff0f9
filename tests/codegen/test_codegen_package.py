"""The package as files: what it contains, how it is written, how it is run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from codegen_helpers import REPO, contiguous, costed, ruff_check
from ftpipe_runtime.job.check import synthetic_inputs
from ftpipe_runtime.stage.api import run_in_one_process

from ftpipe_compiler.codegen import check_package, generate_package, import_package
from ftpipe_compiler.codegen import package as package_module
from ftpipe_compiler.errors import OutputExistsError
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.version import __version__

COMMAND = "ftpipe compile --model t5-tiny --gpus 2"
FILES = {"stages.py", "__init__.py", "__main__.py", "README.md", "plan.json"}


def _generate(tmp_path, model="t5-tiny", k=3, force=False, command=COMMAND):
    spec, _, traced, graph = costed(model)
    plan = contiguous(graph, k, gpus=2)
    return generate_package(traced, graph, plan, spec, tmp_path, command=command, force=force), plan


def _env():
    """The environment of `python -m <pkg>`: no GPU, the compiler not needed but on the path."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


def test_files_and_headers(tmp_path):
    pkg, plan = _generate(tmp_path)
    assert pkg == tmp_path / "t5_tiny_pipeline"
    assert FILES <= {p.name for p in pkg.iterdir()}
    for name in FILES - {"plan.json"}:
        head = (pkg / name).read_text().splitlines()[0]
        assert COMMAND in head and __version__ in head, name
    data = json.loads((pkg / "plan.json").read_text())
    assert COMMAND in data["generated_by"] and __version__ in data["generated_by"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_plan_json_is_what_the_stages_exchange(tmp_path):
    pkg, plan = _generate(tmp_path, "gpt2-tiny", k=4)
    mod = import_package(pkg)
    data = mod.load_plan()
    again = Plan.from_dict(data)  # same schema as any plan
    assert [s.gpu for s in again.stages] == [s.gpu for s in plan.stages]
    sent = {t["tensor"]: t for t in data["transfers"]}
    for sd in data["stages"]:
        cls = mod.STAGES[sd["id"]]
        assert cls.STAGE == sd["id"]
        assert cls.INPUTS == tuple(sd["model_inputs"] + sd["inputs"])
        assert cls.OUTPUTS == (
            ("loss",) if sd["id"] == data["loss_stage"] else tuple(sd["outputs"])
        )
        for name in sd["inputs"]:
            assert sd["id"] in sent[name]["consumers"]
        for name in sd["outputs"]:
            assert sent[name]["producer"] == sd["id"]
    # The shapes and dtypes the runtime will allocate receive buffers with are the real ones.
    stages = {k: cls() for k, cls in mod.STAGES.items()}
    inputs = synthetic_inputs(data)
    produced = {}
    for k in sorted(stages):
        kwargs = {n: inputs[n] if n in inputs else produced[n] for n in stages[k].INPUTS}
        produced.update(stages[k](**kwargs))
    for name, t in sent.items():
        out = produced[name]
        assert list(out.shape) == t["shape"] and str(out.dtype) == f"torch.{t['dtype']}", name
        assert out.is_contiguous()
        assert t["requires_grad"] == out.requires_grad, name
    assert run_in_one_process(stages, data, inputs).item() == pytest.approx(produced["loss"].item())


def test_state_dict_keys_are_the_models_names(tmp_path):
    spec = costed("t5-tiny")[0]
    pkg, plan = _generate(tmp_path)
    mod = import_package(pkg)
    hf_names = set(spec.build("meta").m.state_dict())
    seen = set()
    for k, cls in mod.STAGES.items():
        stage = cls(materialize=False)
        keys = set(stage.state_dict())
        assert keys == set(plan.stages[k].params)
        assert keys <= hf_names
        assert all(t.device.type == "meta" for t in stage.state_dict().values())
        seen |= keys
    assert "shared.weight" in seen
    # The tied embedding / LM head: registered in the one stage owning it, received by others.
    owners = [
        k for k, c in mod.STAGES.items() if "shared.weight" in c(materialize=False).state_dict()
    ]
    readers = [k for k, c in mod.STAGES.items() if "shared.weight" in c.INPUTS]
    assert len(owners) == 1 and readers and min(readers) > owners[0]
    assert "shared.weight" in mod.STAGES[owners[0]].OUTPUTS


def test_refuses_to_overwrite_without_force(tmp_path):
    pkg, _ = _generate(tmp_path)
    before = (pkg / "stages.py").read_text()
    with pytest.raises(OutputExistsError, match="--force"):
        _generate(tmp_path, command="another command")
    assert (pkg / "stages.py").read_text() == before
    _generate(tmp_path, command="another command", force=True)
    assert "another command" in (pkg / "stages.py").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failure_leaves_no_half_package(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(package_module.torch, "save", broken)  # bert writes buffers.pt last
    with pytest.raises(OSError):
        _generate(tmp_path, "bert-tiny")
    assert list(tmp_path.iterdir()) == []


def test_generated_code_passes_ruff(tmp_path):
    for model in ("t5-tiny", "gpt2-tiny", "bert-tiny"):
        _generate(tmp_path / model, model, k=4)
    result = ruff_check(tmp_path)
    if result is None:
        pytest.skip("ruff is not installed")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_traced_device_in_code(tmp_path):
    pkg, _ = _generate(tmp_path)
    code = (pkg / "stages.py").read_text()
    assert "meta" not in code
    assert "device=device" in code  # arange & co. follow the stage's inputs
    assert "# encoder.block.1 (T5Block)" in code  # a reviewer finds the blocks


def test_python_m_check(tmp_path):
    pkg, _ = _generate(tmp_path, "gpt2-tiny", k=3)
    run = subprocess.run(
        [sys.executable, "-m", pkg.name, "--check"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK" in run.stdout


def test_check_catches_a_wrong_stage(tmp_path):
    """The check is not vacuous: a stage computing something else is reported."""
    pkg, _ = _generate(tmp_path, "t5-tiny", k=3)
    code = (pkg / "stages.py").read_text()
    assert code.count("aten.relu.default(") >= 1
    (pkg / "stages.py").write_text(code.replace("aten.relu.default(", "aten.gelu.default(", 1))
    result = check_package(pkg)
    assert not result.ok and result.loss_rel_diff > 1e-5
    run = subprocess.run(
        [sys.executable, "-m", pkg.name, "--check"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1 and "MISMATCH" in run.stdout


def test_materialize_false_costs_no_memory(tmp_path):
    pkg, _ = _generate(tmp_path)
    mod = import_package(pkg)
    stage = mod.STAGES[1](materialize=False)
    assert all(p.is_meta for p in stage.parameters())
    real = mod.STAGES[1](device="cpu", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in real.parameters())


@pytest.mark.multiproc
def test_torchrun_runs_the_package(tmp_path):
    """The entry point hands the plan and stage classes to the runtime: 2 CPU processes, gloo."""
    pytest.importorskip("ftpipe_runtime.job.train")
    pkg, _ = _generate(tmp_path, "t5-tiny", k=4)  # two stages on each rank
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        pkg.name,
        "--steps",
        "2",
        "--device",
        "cpu",
        "--schedule",
        "gpipe",
    ]
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "step 2/2" in run.stdout + run.stderr


def test_readme_shows_multi_node_and_slurm_launches(tmp_path):
    """torchrun across nodes (--nnodes, --node-rank, --rdzv-endpoint) and a SLURM batch script
    (srun torchrun) that is valid bash, for the plan's number of processes."""
    pkg, plan = _generate(tmp_path, "gpt2-tiny", k=2)
    readme = (pkg / "README.md").read_text()
    launch = readme[readme.index("torchrun --nnodes") :].split("\n\n")[0]
    for part in ("--nnodes 2", "--nproc-per-node 1", "--node-rank 0", "--rdzv-endpoint",
                 f"-m {pkg.name}"):  # fmt: skip
        assert part in launch, (part, launch)
    script = readme.split("```bash\n")[1].split("```")[0]
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=1" in script
    assert 'srun bash -c \'torchrun --nnodes "$SLURM_NNODES"' in script
    assert '--node-rank "$SLURM_NODEID"' in script and f"-m {pkg.name}" in script
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    assert f"python -m {pkg.name} --help" in readme


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_readme_multi_node_launch_runs(tmp_path):
    """The README's torchrun line as two one-process "nodes" of this machine: node ranks 0
    and 1 meet at the rendezvous endpoint and train."""
    import shlex
    import socket

    pkg, _ = _generate(tmp_path, "gpt2-tiny", k=2)
    readme = (pkg / "README.md").read_text()
    line = readme[readme.index("torchrun --nnodes") :].split("\n\n")[0].replace("\\\n", " ")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    words = shlex.split(line.replace("node0.example.com:29500", f"127.0.0.1:{port}"))
    assert words[words.index("--nnodes") + 1] == "2"
    words[0:1] = [sys.executable, "-m", "torch.distributed.run"]
    steps = words.index("--steps")
    words[steps:] = ["--steps", "2", "--device", "cpu"]  # not the README's 1000
    procs = []
    for node in (1, 0):
        cmd = [*words]
        cmd[cmd.index("--node-rank") + 1] = str(node)
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=log), log))
    codes = [p.wait(timeout=300) for p, _ in procs]
    for _, log in procs:
        log.close()
    said = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], said + (tmp_path / "node1.log").read_text()
    assert "step 2/2" in said
