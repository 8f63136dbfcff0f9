"""Bad input to the `ftpipe` command line, as a careless or hostile user gives it: each case
exits with status 1 (2 for a usage error) and one sentence, no traceback, and every file
that existed before is byte-identical after. (The runtime's table is
tests/runtime/job/test_runtime_bad_input.py.)"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from ftpipe_runtime.job.signals import Terminated, catch_sigterm

from ftpipe_compiler.cli import cli
from ftpipe_compiler.partition import problem_from_graph, run_partitioners

PROFILE = importlib.import_module("ftpipe_compiler.cli.profile")  # (cli.profile: the command)
PHASES = importlib.import_module("ftpipe_compiler.cli.compile_phases")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_t5_costed):
    """A costed graph and a good plan (t5-tiny on 2 GPUs), and an output folder of before."""
    folder = tmp_path_factory.mktemp("good")
    tiny_t5_costed.save(folder / "graph.json")
    problem = problem_from_graph(tiny_t5_costed, 2)
    plan = run_partitioners(problem, ["even-layers"], progress=False)[0]
    plan.plan.save(folder / "plan.json")
    (folder / "out").mkdir()
    (folder / "out" / "plan.json").write_text("an earlier compile's output")
    return folder


def _edited(source: str, edit):
    """Write bad.json: the good `source` file with `edit` applied to its JSON."""

    def write(folder):
        d = json.loads((folder / source).read_text())
        edit(d)
        (folder / "bad.json").write_text(json.dumps(d))

    return write


def _plan_edit(edit):
    return _edited("plan.json", edit)


def _graph_edit(edit):
    return _edited("graph.json", edit)


def _write(name, data):
    def write(folder):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return write


def _nothing(folder):
    pass


def _link_loop(name):
    def write(folder):
        (folder / name).symlink_to(name)

    return write


# A Llama config.json (no weights): a family whose config transformers validates.
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}  # fmt: skip


def _saved_model(damage):
    """A tiny GPT-2 folder written by save_pretrained (hf/), then `damage(folder)`."""

    def write(folder):
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                         n_positions=32)  # fmt: skip
        transformers.GPT2LMHeadModel(config).save_pretrained(folder / "hf")
        damage(folder / "hf")

    return write


def _config_edit(**changes):
    def edit(hf):
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _set(path, value):
    """An edit setting plan[path[0]][path[1]]... = value."""

    def edit(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return edit


def _two_stages_share_a_node(plan):
    plan["stages"][1]["nodes"].append(plan["stages"][0]["nodes"][0])


SIM = ["simulate", "bad.json"]
PART = ["partition", "graph.json", "--gpus", "2"]
PROF = ["profile", "--model", "gpt2-tiny"]
# (case, files to write first, argv, exit code, what the one sentence says)
CASES = [
    ("compile: unknown schedule", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--schedule", "zigzag"], 2, "Invalid value for '--schedule': unknown schedule 'zigzag'; choose from 1f1b, 2bw, auto, ftpipe, gpipe, interleaved, sync, wpipe, zb1p, zb2p, zbv"),
    ("compile: no schedule", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--schedule", ","], 2, "Invalid value for '--schedule': no schedule named; give auto, sync or a list such as 1f1b,zb1p"),
    ("partition: unknown schedule", _nothing, [*PART, "--schedule", "zigzag"], 2, "Invalid value for '--schedule': 'zigzag' is not one of"),
    ("partition: unknown partitioner", _nothing, [*PART, "-p", "mixed,nope"], 2, "Invalid value for '--partitioners' / '-p': unknown partitioner 'nope'; choose from"),
    ("compile: unknown hardware", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--hardware", "tpu"], 2, "Invalid value for '--hardware': unknown hardware 'tpu'; choose from a100-40gb"),
    ("partition: --gpus 0", _nothing, ["partition", "graph.json", "--gpus", "0"], 2, "'--gpus' / '-g': 0 is not in the range x>=1"),
    ("partition: --micro-batches 0", _nothing, [*PART, "--micro-batches", "0"], 2, "'--micro-batches': 0 is not in the range x>=1"),
    ("partition: a plan for a graph", _nothing, ["partition", "plan.json", "--gpus", "2"], 1, "this file is not an ftpipe graph"),
    ("partition: a graph edge to nowhere", _graph_edit(lambda g: g["edges"].append(["nope", g["output"], 4])), ["partition", "bad.json", "--gpus", "2"], 1, "bad.json is not a valid graph"),
    ("partition: a hand-edited node", _graph_edit(lambda g: g["nodes"][0].update(fwd_s="fast")), ["partition", "bad.json", "--gpus", "2"], 1, "the graph file is incomplete or damaged \\(TypeError: Node field 'fwd_s' cannot be 'fast'\\)"),
    ("partition: -o in a missing folder", _nothing, [*PART, "-o", "no/plan.json"], 1, "cannot write the plan no/plan.json: the folder no does not exist"),
    ("simulate: binary file", _write("bad.json", b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), SIM, 1, "plan file bad.json is not text \\(a binary file\\?\\)"),
    ("simulate: truncated", lambda f: (f / "bad.json").write_text((f / "plan.json").read_text()[:300]), SIM, 1, "plan file bad.json is not valid JSON"),
    ("simulate: a JSON list", _write("bad.json", "[1, 2]"), SIM, 1, "this file is not an ftpipe plan"),
    ("simulate: no stages", _plan_edit(lambda p: p.pop("stages")), SIM, 1, "the plan file is incomplete or damaged \\(KeyError: 'stages'\\)"),
    ("simulate: a stage's gpu as text", _plan_edit(_set(["stages", 0, "gpu"], "one")), SIM, 1, "Stage field 'gpu' cannot be 'one'"),
    ("simulate: stages as a dict", _plan_edit(_set(["stages"], {"0": {}})), SIM, 1, "incomplete or damaged \\(TypeError: Plan field 'stages' cannot be "),
    ("simulate: a stage naming a parameter the plan lacks", _plan_edit(lambda p: p["stages"][0]["params"].append("bogus.weight")), SIM, 1, "stage 0 names the parameter 'bogus.weight', which the plan's params do not list"),
    ("simulate: a node in two stages", _plan_edit(_two_stages_share_a_node), SIM, 1, "bad.json is not a valid plan: nodes \\[.*\\] are in two stages"),
    ("simulate: a stage on a GPU that does not exist", _plan_edit(_set(["stages", 1, "gpu"], 7)), SIM, 1, "not a valid plan: stage 1 is on GPU 7, outside 0..1"),
    ("simulate: a negative time", _plan_edit(_set(["stages", 0, "fwd_s"], -1.0)), SIM, 1, "stage 0 has a negative or non-finite time"),
    ("simulate: a transfer backwards", _plan_edit(lambda p: p["transfers"][0].update(consumers=[0])), SIM, 1, "receives .* from a later stage"),
    ("simulate: a transfer to no stage", _plan_edit(lambda p: p["transfers"][0].update(consumers=[9])), SIM, 1, "names a stage the plan does not have"),
    ("simulate: a missing loss stage", _plan_edit(_set(["loss_stage"], 5)), SIM, 1, "the loss stage 5 is not a stage of the plan"),
    ("simulate: an unknown schedule", _plan_edit(_set(["schedule"], "zigzag")), SIM, 1, "unknown schedule 'zigzag'; choose from"),
    ("simulate: format 3", _plan_edit(_set(["format"], 3)), SIM, 1, "plan format 3 was written by ftpipe"),
    ("simulate: no such file", _nothing, ["simulate", "nope.json"], 1, "plan file nope.json does not exist"),
    ("simulate: a folder", _nothing, ["simulate", "out"], 2, "'PLAN.json...': File 'out' is a directory"),
    ("simulate: --micro-batches 0", _nothing, ["simulate", "plan.json", "-M", "0"], 2, "0 is not in the range x>=1"),
    ("simulate: report in a missing folder", _nothing, ["simulate", "plan.json", "--report", "no/r.html"], 1, "cannot write the report no/r.html: the folder no does not exist"),
    ("profile: invalid config.json", _write("hf/config.json", '{"model_type": "gpt2",'), ["profile", "-m", "hf"], 1, "hf/config.json is not valid JSON \\(Expecting property name"),
    ("profile: config.json not an object", _write("hf/config.json", "[1]"), ["profile", "-m", "hf"], 1, "must hold a JSON object"),
    ("profile: a binary config.json", _write("hf/config.json", b"\xff\xfe\x00"), ["profile", "-m", "hf"], 1, "hf/config.json is not valid JSON"),
    ("profile: config.json of a list type", _write("hf/config.json", '{"model_type": ["gpt2"]}'), ["profile", "-m", "hf"], 1, "hf/config.json must hold a JSON object with a model_type string"),
    ("profile: --seq-len -3", _nothing, [*PROF, "--seq-len", "-3"], 2, "'--seq-len': -3 is not in the range x>=1"),
    ("profile: --seq-len 0", _nothing, [*PROF, "--seq-len", "0"], 2, "'--seq-len': 0 is not in the range x>=1"),
    ("profile: -b 0", _nothing, [*PROF, "-b", "0"], 2, "'--micro-batch' / '-b': 0 is not in the range x>=1"),
    ("profile: --seq-len beyond the positions", _nothing, [*PROF, "--seq-len", "65"], 1, "gpt2-tiny has 64 positions, fewer than the 65 tokens of task .*; pass --seq-len 64 or less"),
    ("profile: --lora without targets", _nothing, [*PROF, "--lora", "r=4,alpha=8"], 2, "Invalid value for '--lora': targets missing; give r=16,alpha=32,targets=q_proj,v_proj\\[,dropout=0.05\\]"),
    ("profile: --lora r not a number", _nothing, [*PROF, "--lora", "r=x,alpha=8,targets=c_attn"], 2, "'--lora': r must be an integer, alpha and dropout numbers"),
    ("profile: --lora unknown key", _nothing, [*PROF, "--lora", "rank=4,alpha=8,targets=c_attn"], 2, "'--lora': unknown key 'rank'"),
    ("profile: --lora dropout 1", _nothing, [*PROF, "--lora", "r=4,alpha=8,targets=c_attn,dropout=1"], 2, "'--lora': r must be >= 1, alpha > 0, dropout in \\[0, 1\\)"),
    ("profile: --lora targets matching nothing", _nothing, [*PROF, "--lora", "r=4,alpha=8,targets=q_proj"], 1, "--lora targets q_proj match no module of the model; its linear layers are named .*c_attn"),
    ("profile: --freeze matching nothing", _nothing, [*PROF, "--freeze", "encoder"], 1, "--freeze 'encoder' matches no parameter \\(matched from the start of the name\\); the model's parameters are named like transformer.wte.weight"),
    ("profile: --freeze not a regex", _nothing, [*PROF, "--freeze", "h.["], 1, "--freeze 'h.\\[' is not a regular expression"),
    ("profile: --freeze everything", _nothing, [*PROF, "--freeze", ".*"], 1, "every parameter of the model is frozen, so there is nothing to train"),
    ("profile: --repeats 0", _nothing, [*PROF, "--repeats", "0"], 2, "'--repeats': 0 is not in the range x>=1"),
    ("profile: --memory-limit -1", _nothing, [*PROF, "--memory-limit", "-1"], 2, "'--memory-limit': -1.0 is not in the range x>0"),
    ("profile: -o in a missing folder", _nothing, [*PROF, "-o", "no/g.json"], 1, "cannot write the graph no/g.json: the folder no does not exist"),
    ("profile: a model torch.export cannot trace", _nothing, ["profile", "-m", "zoo_fixtures:deep_untraceable_model"], 1, "torch.export could not trace zoo_fixtures:deep_untraceable_model: GuardOnDataDependentSymNode"),
    ("profile: a forward that branches on its data", _nothing, ["profile", "-m", "zoo_fixtures:untraceable_model"], 1, "torch.export could not trace zoo_fixtures:untraceable_model: GuardOnDataDependentSymNode"),
    ("profile: the model function raises", _nothing, ["profile", "-m", "zoo_fixtures:raising_model"], 1, "your model function zoo_fixtures:raising_model raised ValueError: no weights in /nowhere"),
    ("profile: the forward raises", _nothing, ["profile", "-m", "zoo_fixtures:forward_raises_model"], 1, "your model's forward raised RuntimeError"),
    ("profile: a function that is not there", _nothing, ["profile", "-m", "zoo_fixtures:nope"], 1, "cannot load model function 'zoo_fixtures:nope'"),
    ("profile: not (model, inputs)", _nothing, ["profile", "-m", "zoo_fixtures:not_a_pair"], 1, "must return \\(model, example_inputs\\)"),
    ("compile: a loss that is not a scalar", _nothing, ["compile", "-m", "zoo_fixtures:vector_model", "-g", "2", "-o", "new"], 1, "returns a float32 of shape \\(4,\\), not a scalar loss"),
    ("compile: -o .", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "-o", ".", "--force"], 1, "is the folder you are in"),
    ("compile: an existing folder", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "-o", "out"], 1, "out already exists; pass --force to replace it"),
    ("compile: --cluster and --gpus-per-node", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "4", "--cluster", "c.json", "--gpus-per-node", "2", "-o", "new"], 2, "give --cluster or --gpus-per-node, not both"),
    ("compile: a missing cluster file", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "4", "--cluster", "none.json", "-o", "new"], 1, "cannot read the cluster file none.json"),
    ("compile: --replicas not dividing --gpus", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "4", "--replicas", "3", "-o", "new"], 2, "--replicas 3 does not divide --gpus 4"),
    ("compile: -2 layers in config.json", _saved_model(_config_edit(n_layer=-2)), ["compile", "-m", "hf", "-g", "2", "--seq-len", "16", "-o", "new"], 1, "hf: config.json says n_layer -2, which no model can have"),
    ("compile: weights of random bytes", _saved_model(lambda hf: (hf / "model.safetensors").write_bytes(bytes(range(256)) * 20)), ["compile", "-m", "hf", "-g", "2", "--seq-len", "16", "-o", "new"], 1, "hf/model.safetensors is not a readable safetensors file"),
    ("compile: a config of fewer layers than its weights", _saved_model(_config_edit(n_layer=1)), ["compile", "-m", "hf", "-g", "2", "--seq-len", "16", "-o", "new"], 1, "hf: the weights are not those of the model its config.json describes: transformer.h.1 not in the model"),
    ("compile: an unknown task", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "-t", "nope", "-o", "new"], 1, "unknown task 'nope'; choose from"),
    # found by the audit (docs/reliability.md)
    ("compile: --hardware a path out of the configs", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--hardware", "../models/gpt2-tiny", "-o", "new"], 2, "unknown hardware '../models/gpt2-tiny'; choose from"),
    ("compile: --cluster of a GPU without figures", _write("c.json", json.dumps({"gpu": {"name": "x"}, "gpus_per_node": 2, "intra_node": {"bandwidth": 1e9}, "inter_node": {"bandwidth": 1e9}})), ["compile", "-m", "gpt2-tiny", "-g", "4", "--cluster", "c.json", "-o", "new"], 1, "hardware 'x': name, memory_bytes, peak_flops, memory_bandwidth, link_bandwidth are required, the numbers finite and positive \\(memory_bytes, peak_flops, memory_bandwidth, link_bandwidth is not\\)"),
    ("compile: -o a symlink to itself", _link_loop("loop"), ["compile", "-m", "gpt2-tiny", "-g", "2", "-o", "loop"], 1, "cannot write loop: Symlink loop from .*; choose another folder with -o"),
    ("compile: fp16 under the asynchronous schedule only", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--dtype", "fp16", "--schedule", "ftpipe", "-o", "new"], 1, "--dtype fp16 scales the loss by a factor all stages change together, and ftpipe does not step them together"),
    ("profile: heads not dividing the width", _write("hf/config.json", json.dumps({**LLAMA, "num_attention_heads": 5})), ["profile", "-m", "hf"], 1, "hf: cannot use this llama model \\(.*The hidden size \\(32\\) is not a multiple of the number of attention heads \\(5\\)"),
    ("partition: a node cost NaN", _graph_edit(lambda g: g["nodes"][3].update(fwd_s=float("nan"))), ["partition", "bad.json", "--gpus", "2"], 1, "bad.json is not a valid graph: node .* has a negative or non-finite cost"),
    ("simulate: --steps 10^9", _nothing, ["simulate", "plan.json", "--steps", "1000000000"], 1, "1000000000 steps of 4 micro-batches on 2 stages are 2.4e\\+10 actions to simulate, more than 5e\\+06"),
    ("simulate: --micro-batches 10^7", _nothing, ["simulate", "plan.json", "-M", "10000000"], 1, "actions to simulate, more than 5e\\+06 \\(minutes\\); lower --steps or --micro-batches"),
    # an output that would delete or overwrite an input, or the user's files (--force)
    ("compile --force: -o the model folder", _write("hf/config.json", json.dumps(LLAMA)), ["compile", "-m", "hf", "-g", "2", "-o", "hf", "--force"], 1, "hf is the model folder hf, which this command reads; choose another folder with -o"),
    ("compile --force: -o a folder holding the model", _write("m/hf/config.json", json.dumps(LLAMA)), ["compile", "-m", "m/hf", "-g", "2", "-o", "m", "--force"], 1, "m holds the model folder m/hf, which this command reads and replacing m would delete; choose another folder with -o"),
    ("compile --force: -o a folder holding the data", _write("d/train.jsonl", '{"text": "hi"}\n'), ["compile", "-m", "gpt2-tiny", "-g", "2", "--data", "d/train.jsonl", "-o", "d", "--force"], 1, "d holds the data d/train.jsonl, which this command reads and replacing d would delete"),
    ("compile --force: -o a folder holding the chat template", _write("out/t.jinja", "{{ messages }}"), ["compile", "-m", "gpt2-tiny", "-g", "2", "--data", "train.jsonl", "--chat-field", "m", "--chat-template", "out/t.jinja", "-o", "out", "--force"], 1, "out holds the chat template out/t.jinja, which this command reads"),
    ("compile --force: -o a folder holding the cluster file", _write("out/c.json", "{}"), ["compile", "-m", "gpt2-tiny", "-g", "4", "--cluster", "out/c.json", "-o", "out", "--force"], 1, "out holds the cluster file out/c.json, which this command reads"),
    ("compile --force: -o a folder holding the user's notes", _write("out/notes.txt", "mine"), ["compile", "-m", "gpt2-tiny", "-g", "2", "-o", "out", "--force"], 1, "out holds files ftpipe compile does not write \\(notes.txt\\), which replacing it would delete; move them, or choose another folder with -o"),
    ("compile: -o a folder holding a run's checkpoints", _write("out/checkpoints/step-1/stage-0.pt", b"weights"), ["compile", "-m", "gpt2-tiny", "-g", "2", "-o", "out"], 1, "out holds files ftpipe compile does not write \\(checkpoints\\)"),
    ("simulate: --report the plan", _nothing, ["simulate", "plan.json", "--report", "plan.json"], 1, "the report plan.json is the plan plan.json, which this command reads; choose another file with --report"),
    ("simulate: --report the plan by another path", _nothing, ["simulate", "plan.json", "--report", "out/../plan.json"], 1, "the report out/../plan.json is the plan plan.json"),
    ("simulate: --report the trace", _write("t.json", "{}"), ["simulate", "plan.json", "--compare", "t.json", "--report", "t.json"], 1, "the report t.json is the trace t.json"),
    ("partition: -o the graph", _nothing, [*PART, "-o", "graph.json"], 1, "the plan graph.json is the graph graph.json, which this command reads; choose another file with -o"),
    ("partition: -o a hard link of the graph", lambda f: os.link(f / "graph.json", f / "g2.json"), [*PART, "-o", "g2.json"], 1, "the plan g2.json is the graph graph.json"),
    ("profile: -o the model's config.json", _write("hf/config.json", json.dumps(LLAMA)), ["profile", "-m", "hf", "-o", "hf/config.json"], 1, "the graph hf/config.json is inside the model folder hf, which this command reads and must not change; choose another file with -o"),
    # a float option of nan or inf (nan passed every range check)
    ("profile: --memory-limit nan", _nothing, [*PROF, "--profile", "measured", "--memory-limit", "nan"], 2, "Invalid value for '--memory-limit': nan is not a finite number"),
    ("profile: --memory-limit inf", _nothing, [*PROF, "--profile", "measured", "--memory-limit", "inf"], 2, "'--memory-limit': inf is not a finite number"),
    ("compile: --memory-limit inf", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--profile", "measured", "--memory-limit", "inf", "-o", "new"], 2, "'--memory-limit': inf is not a finite number"),
    ("compile: --freeze-training nan", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--freeze-training", "nan", "-o", "new"], 2, "'--freeze-training': nan is not a finite number"),
    ("compile: --len-percentile nan", _nothing, ["compile", "-m", "gpt2-tiny", "-g", "2", "--data", "train.jsonl", "--len-percentile", "nan", "-o", "new"], 2, "'--len-percentile': nan is not a finite number"),
]  # fmt: skip


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case, setup, argv, code, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, setup, argv, code, message, files, tmp_path, monkeypatch):
    for p in files.iterdir():
        (shutil.copytree if p.is_dir() else shutil.copy)(p, tmp_path / p.name)
    setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and not isinstance(r.exception, (KeyError, AttributeError))
    said = r.output.strip().split("\n")[-1]
    assert re.search(message, said), r.output
    if code == 1:
        # one sentence, on one line (after the lines of the phases that ran)
        errors = [line for line in r.output.splitlines() if line.startswith("Error: ")]
        assert errors == [said], r.output
    assert _snapshot(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries


def test_debug_shows_what_the_exporter_printed(tmp_path, monkeypatch):
    """The partial graph a failed export prints is dropped, and shown with --debug."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["--debug", "profile", "-m", "zoo_fixtures:deep_untraceable_model"])
    assert type(r.exception).__name__ == "TraceError"
    # the partial graph, one line per op (no source lines: the export emits none)
    assert "def forward(self" in r.output and r.output.count("aten.") > 20


def test_one_line_from_the_installed_command_too(files, tmp_path):
    """Outside CliRunner: the console script, a damaged plan, stdout left empty."""
    (tmp_path / "bad.json").write_bytes(b"\x89PNG\xff\xfe binary")
    out = subprocess.run(
        [sys.executable, "-m", "ftpipe_compiler", "simulate", str(tmp_path / "bad.json")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "is not text" in out.stderr


def _raises(error):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize(
    "error, said",
    [
        (MemoryError(), "out of memory \\(MemoryError\\); make the model, --micro-batch or --seq-len smaller"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 128000000000 bytes."), "out of memory \\(.*you tried to allocate 128000000000 bytes.\\); make the model, --micro-batch or --seq-len smaller"),
        (IndexError("list index out of range"), "unexpected error: IndexError: list index out of range \\(--debug shows where\\)"),
    ],
    ids=["MemoryError", "torch's allocator", "a bug"],
)  # fmt: skip
def test_an_unforeseen_error_is_one_line(error, said, monkeypatch):
    """--micro-batch 10^9 made a 128 GB input tensor: torch's allocator error, a raw traceback.
    Whatever a command did not foresee is one line (--debug: the traceback)."""
    monkeypatch.setattr(PROFILE, "costed_graph", _raises(error))
    r = CliRunner().invoke(cli, ["profile", "-m", "gpt2-tiny"])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert re.fullmatch(f"Error: {said}\n", r.output), r.output
    r = CliRunner().invoke(cli, ["--debug", "profile", "-m", "gpt2-tiny"])
    assert r.exception is error


def test_sigterm_while_writing_keeps_the_earlier_output(tmp_path, monkeypatch):
    """SIGTERM (`kill`, a batch system's stop) unwinds like Ctrl-C: the package being built
    beside the earlier output goes, the earlier output stays, one line, exit code 143."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "plan.json").write_text("an earlier compile's output")
    monkeypatch.setattr(PHASES, "generate_package", _raises(Terminated()))
    argv = ["compile", "-m", "gpt2-tiny", "-g", "2", "-p", "even-layers", "--schedule", "gpipe"]
    r = CliRunner().invoke(cli, [*argv, "-o", "out", "--force"])
    assert r.exit_code == 143, r.output
    # (the phases that ran before it say so, one line each: the runner is no terminal)
    assert r.output.splitlines()[-1] == "Stopped (SIGTERM); outputs that existed are unchanged."
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it
    assert (tmp_path / "out" / "plan.json").read_text() == "an earlier compile's output"


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted \\(Ctrl-C\\)"),
                                             (signal.SIGTERM, 143, "stopped \\(SIGTERM\\)")])  # fmt: skip
def test_a_signal_while_starting_is_one_line(sig, code, said):
    """Ctrl-C (or SIGTERM) while the command still imports torch: one line and 130 (143),
    not the traceback of an import."""
    # (`ftpipe models` loads no torch and is done at once: `compile` loads it, then its help)
    child = subprocess.Popen([sys.executable, "-m", "ftpipe_compiler", "compile", "--help"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)  # well inside the imports (seconds)
    child.send_signal(sig)
    out, err = child.communicate(timeout=60)
    assert child.returncode == code, err
    assert re.fullmatch(f"ftpipe: {said}; nothing was written \\(while starting\\)\n", err), err


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:  # gone, or no /proc
        return []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the workers")
@pytest.mark.parametrize("group", [True, False], ids=["its process group", "ftpipe alone"])
def test_sigterm_while_the_workers_search_is_one_line(tmp_path, group):
    """SIGTERM while the forked workers evaluate the partition x schedule matrix (the audit's
    T5-3B case). The workers inherited the command's SIGTERM handler: each raised Terminated
    and printed a multiprocessing traceback ("Process ForkProcess-1:"), or caught it as its
    cell's error and waited for more work while ftpipe joined it (a hang). Now they leave the
    signal to ftpipe: one line, 143, the earlier output unchanged, no worker left."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "plan.json").write_text("an earlier compile's output")
    argv = ["compile", "-m", "t5-tiny", "-g", "4", "-o", "out", "--force"]
    child = subprocess.Popen([sys.executable, "-m", "ftpipe_compiler", *argv], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (workers := _children(child.pid)) and child.poll() is None:
        assert time.monotonic() < deadline, "the search's workers never started"
        time.sleep(0.01)
    assert child.poll() is None, "the compile ended before its workers were seen"
    time.sleep(0.2)  # the workers busy with their cells
    (os.killpg if group else os.kill)(child.pid, signal.SIGTERM)
    try:
        out, err = child.communicate(timeout=60)
        grace = time.monotonic() + 5  # (init reaps the workers of a parent that ended)
        while (
            left := [w for w in workers if Path(f"/proc/{w}").exists()]
        ) and time.monotonic() < grace:
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # a hung compile, or workers it left
    assert child.returncode == 143, err
    assert err.splitlines()[-1] == "Stopped (SIGTERM); outputs that existed are unchanged.", err
    assert "Traceback" not in err and "Process ForkProcess" not in err, err
    assert not left, f"workers left running: {left}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["plan.json"]
    assert (tmp_path / "out" / "plan.json").read_text() == "an earlier compile's output"


STOPS = [(signal.SIGINT, 130, "Interrupted (Ctrl-C)"), (signal.SIGTERM, 143, "Stopped (SIGTERM)")]


@pytest.fixture
def sigterm_caught():
    """SIGTERM raises Terminated here, as `ftpipe` sets it up (the runner does not)."""
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    catch_sigterm()
    yield
    signal.signal(signal.SIGTERM, old)


def _signal_self(sig) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(1000):  # its handler runs here
        pass
    raise AssertionError(f"{sig!r} was not delivered")


@pytest.mark.parametrize("sig, code, said", STOPS, ids=["Ctrl-C", "SIGTERM"])
def test_a_stop_a_library_swallowed_still_stops_the_compile(tmp_path, monkeypatch, sigterm_caught, sig, code, said):  # fmt: skip
    """A library that drops the exception a signal raised (Python's at-fork hooks, a
    `__del__`, a bare `except`): the compile went on, replaced the output and exited 0.
    It stops at the end of that phase, before anything is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "plan.json").write_text("an earlier compile's output")
    search = PHASES.search_schedules

    def swallowing(job, progress):
        try:
            _signal_self(sig)
        except KeyboardInterrupt:  # (Terminated is one too)
            pass
        search(job, progress)

    monkeypatch.setattr(PHASES, "search_schedules", swallowing)
    argv = ["compile", "-m", "gpt2-tiny", "-g", "2", "-p", "even-layers", "--schedule", "gpipe"]
    r = CliRunner().invoke(cli, [*argv, "-o", "out", "--force"])
    assert r.exit_code == code, r.output
    assert r.output.splitlines()[-1] == f"{said}; outputs that existed are unchanged.", r.output
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out" / "plan.json").read_text() == "an earlier compile's output"


@pytest.mark.parametrize("sig, code, said", STOPS, ids=["Ctrl-C", "SIGTERM"])
def test_an_error_a_library_made_of_a_stop_is_that_stop(monkeypatch, sigterm_caught, sig, code, said):  # fmt: skip
    """SIGTERM while transformers imported the model's module lazily (the T5-3B compile, 7 s
    in): transformers wrapped it ("Could not import module 'T5ForConditionalGeneration'"),
    and ftpipe said "cannot use this t5 model" and exited 1. It is the stop."""

    def wrapping(*args, **kwargs):
        try:
            _signal_self(sig)
        except KeyboardInterrupt as e:
            raise RuntimeError("Could not import module 'T5ForConditionalGeneration'") from e

    monkeypatch.setattr(PROFILE, "costed_graph", wrapping)
    r = CliRunner().invoke(cli, ["profile", "-m", "gpt2-tiny"])
    assert r.exit_code == code, r.output
    assert r.output == f"{said}; outputs that existed are unchanged.\n", r.output


def test_a_reader_that_went_away_ends_the_command_quietly():
    """`ftpipe models | head -1`: the pipe closed before the command wrote; it printed
    "unexpected error: BrokenPipeError" (from `simulate plan.json | head`). Now nothing on
    stderr and 141, what a shell reports for a process SIGPIPE stopped."""
    child = subprocess.Popen([sys.executable, "-m", "ftpipe_compiler", "models"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    child.stdout.close()  # before the child writes a byte
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 141, err
    assert err == ""
