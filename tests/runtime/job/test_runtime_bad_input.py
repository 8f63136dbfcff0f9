"""Bad input to the runtime, as a careless or hostile user gives it: each case stops before
training with one sentence (exit status 1, or 2 for a usage error), no traceback, and every
file that existed before is byte-identical after.

Cases run `ftpipe_runtime.job.train` in this process on the toy's one-rank plan (no
torch.distributed needed); the last tests run a generated package as a process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import pytest
import torch
from ftpipe_runtime import run
from runtime_helpers import RUNTIME_HOME
from runtime_toy import STAGES, V, one_rank_plan, toy_plan
from text_helpers import WORDS, write_tokenizer


def _pt(obj):
    def write(path):
        torch.save(obj, path)

    return write


def _bytes(data: bytes):
    return lambda path: path.write_bytes(data)


def _lines(*lines: str):
    return lambda path: path.write_text("\n".join(lines) + "\n")


def _tokenizer(path):
    write_tokenizer(path, words=WORDS[:10])  # 14 tokens: the toy's vocabulary has 16


TOK, TOK_ARG = {"tok": _tokenizer}, ["--tokenizer", "tok"]
CHAT_LINE = json.dumps(
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]}
)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CHAT_ARGS = ["--chat-field", "messages", *TOK_ARG]
USER_LINE = json.dumps({"messages": [{"role": "user", "content": "one two"}]})
USER_TEMPLATE = (  # the assistant's messages left out
    "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }} {% endif %}"
    "{% endfor %}"
)
GOOD_ROWS = [[1, 2, 3, 4, 5, 6]] * 4
# (case, files to write first {name: writer}, argv, exit code, what the one sentence says)
CASES = [
    ("empty .pt", {"d.pt": _bytes(b"")}, ["--data", "d.pt"], 1, "d.pt is empty; give one sample per line or row"),
    ("garbage .pt", {"d.pt": _bytes(b"\x80garbage" * 9)}, ["--data", "d.pt"], 1, "not a torch file"),
    ("float .pt", {"d.pt": _pt(torch.rand(4, 6))}, ["--data", "d.pt"], 1, "holds torch.float32 values; token ids are integers"),
    ("0-d .pt", {"d.pt": _pt(torch.tensor(3))}, ["--data", "d.pt"], 1, "'input_ids' is a single number"),
    ("a list in .pt", {"d.pt": _pt([1, 2])}, ["--data", "d.pt"], 1, "expected a tensor or a dict of tensors"),
    ("unequal columns", {"d.pt": _pt({"input_ids": torch.ones(4, 6, dtype=torch.long), "labels": torch.ones(3, 6, dtype=torch.long)})}, ["--data", "d.pt"], 1, "every column needs the same"),
    ("bad .jsonl line", {"d.jsonl": _lines("[1, 2, 3]", "[1, 2,")}, ["--data", "d.jsonl"], 1, "d.jsonl line 2: Expecting"),
    ("strings in .jsonl", {"d.jsonl": _lines('{"input_ids": ["a", "b"]}')}, ["--data", "d.jsonl"], 1, "line 1: 'input_ids' is not a list of integers"),
    ("out-of-vocabulary id", {"d.pt": _pt({"input_ids": torch.full((4, 6), V), "labels": torch.ones(4, 6, dtype=torch.long)})}, ["--data", "d.pt"], 1, f"sample 0 has input_ids {V}, outside the vocabulary 0..{V - 1}"),
    ("negative id", {"d.jsonl": _lines(json.dumps({"input_ids": [1, -5], "labels": [1, 1]}))}, ["--data", "d.jsonl"], 1, "input_ids -5, outside the vocabulary"),
    ("labels all padding", {"d.pt": _pt({"input_ids": torch.ones(4, 6, dtype=torch.long), "labels": torch.full((4, 6), -100)})}, ["--data", "d.pt"], 1, "no sample has a token to predict"),
    ("an input not in the file", {"d.pt": _pt({"labels": torch.ones(4, 6, dtype=torch.long)})}, ["--data", "d.pt"], 1, "the data file has no 'input_ids' and it cannot be derived"),
    ("missing data file", {}, ["--data", "nope.pt"], 1, "no data file nope.pt"),
    ("unknown data", {}, ["--data", "wikipedia"], 1, "unknown data 'wikipedia'; choose from"),
    ("wrong-shape --init", {"w.pt": _pt({"emb.weight": torch.zeros(V, 3)})}, ["--init", "w.pt"], 1, f"emb.weight has shape \\({V}, 3\\), stage 0 expects \\({V}, 8\\)"),
    ("garbage --init", {"w.pt": _bytes(b"not a state dict")}, ["--init", "w.pt"], 1, "--init w.pt is not a state dict of tensors"),
    ("missing --init", {}, ["--init", "nope.pt"], 1, "--init nope.pt: no such file"),
    ("--init of a list", {"w.pt": _pt([torch.zeros(2)])}, ["--init", "w.pt"], 1, "holds a list, not a state dict"),
    ("unwritable --log-json", {}, ["--log-json", "no/such/dir/log.json"], 1, "cannot write --log-json no/such/dir/log.json: the folder no/such/dir does not exist"),
    ("--log-json a folder", {"logs/keep": _bytes(b"x")}, ["--log-json", "logs"], 1, "cannot write --log-json logs: it is a folder"),
    ("unwritable --trace", {}, ["--trace", "no/such/dir/trace.json"], 1, "cannot write --trace no/such/dir/trace.json: the folder no/such/dir does not exist"),
    ("checkpoint folder is a file", {"ck": _bytes(b"mine")}, ["--save-every", "1", "--checkpoint-dir", "ck"], 1, "cannot make the checkpoint folder ck"),
    ("--timeout 0", {}, ["--timeout", "0"], 2, "argument --timeout: 0 must be above 0"),
    ("--timeout -1", {}, ["--timeout", "-1"], 2, "argument --timeout: -1 must be above 0"),
    ("--lr nan", {}, ["--lr", "nan"], 2, "argument --lr: nan is not a finite number"),
    ("--lr inf", {}, ["--lr", "inf"], 2, "argument --lr: inf is not a finite number"),
    ("--lr -1", {}, ["--lr", "-1"], 2, "argument --lr: -1 must be at least 0"),
    ("--lr text", {}, ["--lr", "fast"], 2, "argument --lr: 'fast' is not a number"),
    ("--clip nan", {}, ["--clip", "nan"], 2, "argument --clip: nan is not a finite number"),
    ("--save-every -1", {}, ["--save-every", "-1"], 2, "argument --save-every: -1 must be at least 0"),
    ("--steps 0", {}, ["--steps", "0"], 2, "argument --steps: 0 must be at least 1"),
    ("--micro-batches 0", {}, ["--micro-batches", "0"], 2, "argument --micro-batches: 0 must be at least 1"),
    ("--warmup -2", {}, ["--warmup", "-2"], 2, "argument --warmup: -2 must be at least 0"),
    ("--log-every 0", {}, ["--log-every", "0"], 2, "argument --log-every: 0 must be at least 1"),
    ("--keep-checkpoints -1", {}, ["--keep-checkpoints", "-1"], 2, "argument --keep-checkpoints: -1 must be at least 0"),
    ("--steps 1.5", {}, ["--steps", "1.5"], 2, "argument --steps: '1.5' is not an integer"),
    ("unknown schedule", {}, ["--schedule", "zigzag"], 2, "argument --schedule: unknown schedule 'zigzag'; choose from gpipe"),
    # text data (the toy compiles 6 tokens; TOK: a tokenizer folder)
    ("missing text file", TOK, ["--data", "nope.csv", *TOK_ARG], 1, "no data file nope.csv"),
    ("missing field", {**TOK, "d.jsonl": _lines('{"question": "one two"}')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl has no field 'text' \\(it has question\\); name the text with --text-field"),
    ("missing target field", {**TOK, "d.csv": _lines("q,a", "one,two")}, ["--data", "d.csv", "--prompt-field", "q", "--target-field", "answer", *TOK_ARG], 1, "d.csv has no field 'answer' \\(it has q, a\\)"),
    ("empty text file", {**TOK, "d.jsonl": _bytes(b"")}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl is empty; give one sample per line or row"),
    ("only empty texts", {**TOK, "d.txt": _lines("", "  ")}, ["--data", "d.txt", *TOK_ARG], 1, "d.txt holds only empty texts"),
    ("over-long text", {**TOK, "d.jsonl": _lines('{"text": "one two"}', '{"text": "one two three four five six seven"}')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl sample 2 has 8 tokens of input_ids, more than the 6 the package was compiled for; pass --truncate to cut such texts, or compile again with a longer --seq-len"),
    ("invalid UTF-8 in .jsonl", {**TOK, "d.jsonl": _bytes(b'{"text": "one two"}\n{"text": "one \xe9 two"}\n')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl line 2 \\(byte 34\\) is not UTF-8 text \\(invalid continuation byte\\); save the file as UTF-8"),
    ("invalid UTF-8 in .csv", {**TOK, "d.csv": _bytes(b"text\none two\n\xff\n")}, ["--data", "d.csv", *TOK_ARG], 1, "d.csv line 3 \\(byte 13\\) is not UTF-8 text"),
    ("a .txt cut inside a character", {**TOK, "d.txt": _bytes("one two\nthree €".encode()[:-1])}, ["--data", "d.txt", *TOK_ARG], 1, "d.txt line 2 \\(byte 14\\) is not UTF-8 text \\(unexpected end of data\\)"),
    ("a number as text", {**TOK, "d.jsonl": _lines('{"text": 7}')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl sample 1: field 'text' holds int, not text"),
    ("unreadable csv", {**TOK, "d.parquet": _bytes(b"PAR1 not really")}, ["--data", "d.parquet", *TOK_ARG], 1, "d.parquet cannot be read as parquet"),
    ("chat without a template", {**TOK, "d.jsonl": _lines(CHAT_LINE)}, ["--data", "d.jsonl", "--chat-field", "messages", *TOK_ARG], 1, "the tokenizer has no chat template to render --chat-field with; pass --chat-template FILE \\(a Jinja template\\)"),
    ("a chat role unknown", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines(CHAT_LINE, '{"messages": [{"role": "bot", "content": "one"}]}')}, ["--data", "d.jsonl", "--chat-field", "messages", "--chat-template", "t.jinja", *TOK_ARG], 1, "d.jsonl line 2: message 1 has the unknown role 'bot'; roles are system"),
    ("no tokenizer", {"d.jsonl": _lines('{"text": "one two"}')}, ["--data", "d.jsonl"], 1, "text data needs the model's tokenizer, and the plan names no model folder; pass --tokenizer FOLDER"),
    ("a bad eval file", {**TOK, "d.jsonl": _lines('{"text": "one two"}')}, ["--data", "d.jsonl", "--eval-data", "v.jsonl", *TOK_ARG], 1, "no data file v.jsonl"),
    ("--eval-every without eval data", {}, ["--eval-every", "2"], 1, "--eval-every needs an evaluation set: pass --eval-data FILE"),
    ("--epochs and --steps", {}, ["--epochs", "1"], 2, "argument --epochs: not allowed with argument --steps"),
    ("--epochs 0", {}, ["--epochs", "0"], 2, "argument --epochs: 0 must be above 0"),
    ("--freeze-alpha 1", {}, ["--freeze-alpha", "1"], 2, "argument --freeze-alpha: 1 must be below 1"),
    ("--save-hf of a function model", {}, ["--save-hf", "out"], 1, "a HuggingFace folder needs a HuggingFace model"),
    ("--dtype unknown", {}, ["--dtype", "fp8"], 2, "argument --dtype: invalid choice: 'fp8'"),
    ("--decay unknown", {}, ["--decay", "step"], 2, "argument --decay: invalid choice: 'step'"),
    ("--decay-fraction above 1", {}, ["--decay-fraction", "1.5"], 2, "argument --decay-fraction: 1.5 must be at most 1"),
    ("--adam-beta2 of 1", {}, ["--adam-beta2", "1"], 2, "argument --adam-beta2: 1 must be below 1"),
    ("--dtype bf16 of an fp32 package", {}, ["--dtype", "bf16"], 1, "--dtype bf16: it was compiled in fp32; compile it with --dtype bf16 to train so"),
    ("freeze training under an asynchronous schedule", {}, ["--schedule", "ftpipe", "--freeze-at", "1:1"], 1, "freeze training needs a synchronous schedule, not ftpipe; pick gpipe or 1f1b"),
    # found by the audit (docs/reliability.md)
    ("--seed 10^30", {}, ["--seed", "1" + "0" * 30], 2, "argument --seed: 1000000000000000000000000000000 must be below 2147483648"),
    ("--micro-batches 10^9", {}, ["--micro-batches", "1000000000"], 2, "argument --micro-batches: 1000000000 must be at most 65536"),
    ("a NUL byte in a .csv", {**TOK, "d.csv": _bytes(b"text\none two\nthree\x00four\n")}, ["--data", "d.csv", *TOK_ARG], 1, "d.csv line 3 \\(byte 18\\) holds a NUL byte, which text does not; is it a binary file\\?"),
    ("invalid UTF-8 in a .jsonl of token ids", {"d.jsonl": _bytes(b'[1, 2, 3]\n{"input_ids": [4, 5], "note\xff": [1]}\n')}, ["--data", "d.jsonl"], 1, "d.jsonl line 2 \\(byte 37\\) is not UTF-8 text \\(invalid start byte\\); save the file as UTF-8"),
    ("--log-dir a file", {"logs": _bytes(b"mine")}, ["--log-dir", "logs"], 1, "cannot make the log folder logs: it is a file"),
    ("--trace in a file", {"afile": _bytes(b"mine")}, ["--trace", "afile/t.json"], 1, "cannot write --trace afile/t.json: afile is a file, not a folder"),
    ("--tensorboard a file", {"afile": _bytes(b"mine")}, ["--tensorboard", "afile"], 1, "cannot make the TensorBoard folder afile: afile is a file"),
    # a .jsonl that shows neither text nor token ids was read as token ids ("holds token ids")
    ("missing .jsonl with text options", TOK, ["--data", "nope.jsonl", *CHAT_ARGS], 1, "ftpipe: no data file nope.jsonl$"),
    ("a folder as data", {**TOK, "d.jsonl/x": _bytes(b"x")}, ["--data", "d.jsonl", *CHAT_ARGS], 1, "the data file d.jsonl is a folder; give a file"),
    ("blank .jsonl with text options", {**TOK, "d.jsonl": _lines("", "  ", "")}, ["--data", "d.jsonl", *CHAT_ARGS], 1, "d.jsonl holds no samples, only blank lines; give one sample per line or row"),
    ("blank .jsonl", {"d.jsonl": _lines("", "  ")}, ["--data", "d.jsonl"], 1, "d.jsonl holds no samples, only blank lines"),
    ("blank eval .jsonl", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines(CHAT_LINE), "v.jsonl": _lines(" ")}, ["--data", "d.jsonl", "--eval-data", "v.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja"], 1, "v.jsonl holds no samples, only blank lines"),
    ("missing eval .jsonl", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines(CHAT_LINE)}, ["--data", "d.jsonl", "--eval-data", "v.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja"], 1, "ftpipe: no data file v.jsonl$"),
    ("UTF-16 .jsonl", {**TOK, "d.jsonl": _bytes((CHAT_LINE + "\n").encode("utf-16"))}, ["--data", "d.jsonl", *CHAT_ARGS], 1, "d.jsonl is not UTF-8 text but UTF-16 \\(it begins with UTF-16's byte-order mark\\); save the file as UTF-8"),
    ("UTF-16 .jsonl without a byte-order mark", {**TOK, "d.jsonl": _bytes('{"text": "one two"}\n'.encode("utf-16-le"))}, ["--data", "d.jsonl", "--text-field", "text", *TOK_ARG], 1, "d.jsonl is not UTF-8 text but UTF-16 \\(a NUL byte beside every character\\)"),
    ("UTF-16 .jsonl of token ids", {"d.jsonl": _bytes(b"[1, 2, 3]\n".decode().encode("utf-16"))}, ["--data", "d.jsonl"], 1, "d.jsonl is not UTF-8 text but UTF-16"),
    ("first line not JSON with text options", {**TOK, "d.jsonl": _lines("{not json", CHAT_LINE)}, ["--data", "d.jsonl", *CHAT_ARGS], 1, "d.jsonl line 1 is not JSON \\(Expecting property name enclosed in double quotes at column 2\\); give one JSON object per line"),
    ("a text .jsonl with its first line broken", {**TOK, "d.jsonl": _lines('{"text": "one', '{"text": "one two"}')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl line 1 is not JSON \\(Unterminated string starting at column 10\\)"),
    ("line 6 not JSON", {**TOK, "d.jsonl": _lines(*['{"text": "one two"}'] * 4, "", '{"text": "one" "two"}', '{"text": "three"}')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl line 6 is not JSON \\(Expecting ',' delimiter at column 16\\)"),
    ("an array among objects", {**TOK, "d.jsonl": _lines('{"text": "one two"}', "[1, 2]")}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl line 2 holds a JSON array, not an object; give one JSON object of fields per line"),
    ("no assistant turn", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines(*[USER_LINE] * 40)}, ["--data", "d.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja"], 1, "d.jsonl: no conversation has an assistant turn to learn from \\(the loss is on the assistant's messages only\\); give conversations with assistant replies"),
    ("no assistant turn, packed", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines(*[USER_LINE] * 40)}, ["--data", "d.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja", "--pack"], 1, "d.jsonl: no conversation has an assistant turn to learn from"),
    ("a template without the assistant's words", {**TOK, "t.jinja": _lines(USER_TEMPLATE), "d.jsonl": _lines(CHAT_LINE)}, ["--data", "d.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja", "--pack"], 1, "d.jsonl: the chat template t.jinja never renders the assistant messages' content, so there is nothing to learn"),
    ("an empty conversation", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines('{"messages": []}')}, ["--data", "d.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja"], 1, "d.jsonl line 1: the chat field holds no messages \\(an empty list\\); give a list of \\{role, content\\} messages, or leave the sample out"),
    ("a line without the chat field", {**TOK, "t.jinja": _lines(CHAT_TEMPLATE), "d.jsonl": _lines(CHAT_LINE, "", '{"talk": [], "id": 2}')}, ["--data", "d.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja"], 1, "d.jsonl line 3 has no field 'messages' \\(it has talk, id\\); give every sample the field --chat-field names"),
    ("a line without the text field", {**TOK, "d.jsonl": _lines('{"text": "one two"}', '{"body": "one two"}')}, ["--data", "d.jsonl", *TOK_ARG], 1, "d.jsonl line 2 has no field 'text' \\(it has body\\); give every sample the field --text-field names"),
    ("a null prompt", {**TOK, "d.jsonl": _lines('{"q": "one", "a": "two"}', '{"q": null, "a": "two"}')}, ["--data", "d.jsonl", "--prompt-field", "q", "--target-field", "a", *TOK_ARG], 1, "d.jsonl line 2 has no value in field 'q'; give it one, or leave the sample out"),
    ("a chat template that does not parse", {**TOK, "t.jinja": _lines("{% for m in messages %}{{ m['content'] }"), "d.jsonl": _lines(CHAT_LINE)}, ["--data", "d.jsonl", *CHAT_ARGS, "--chat-template", "t.jinja"], 1, "ftpipe: the chat template t.jinja has a syntax error on its line 1 \\(unexpected '}'\\); fix it, or pass another with --chat-template FILE$"),
]  # fmt: skip


def _plan_with(**changes):
    plan = one_rank_plan()
    plan.update(changes)
    return plan


def _stage_on(gpu):
    plan = one_rank_plan()
    plan["stages"][2]["gpu"] = gpu
    return plan


# (case, plan, exit code, what the one sentence says)
PLANS = [
    ("a GPU without a stage", _plan_with(gpus=2), 1, "the plan gives GPU 1 no stage"),
    ("a stage on a GPU that does not exist", _stage_on(5), 1, "is on GPU 5, outside 0..0"),
    ("another format", _plan_with(format=99), 1, "plan format 99 was written by ftpipe .*; this ftpipe reads formats 1 and 2"),
    ("not a plan", _plan_with(kind="ftpipe-graph"), 1, "this file is not an ftpipe plan"),
    ("no stages key", {k: v for k, v in one_rank_plan().items() if k != "stages"}, 1, "the plan file is incomplete or damaged \\(KeyError: 'stages'\\)"),
    ("a stage id that is text", _plan_with(loss_stage="three"), 1, "incomplete or damaged \\(TypeError: Plan field 'loss_stage' cannot be 'three'"),
    ("a transfer backwards", _plan_with(transfers=[{**t, "producer": 3} if t["tensor"] == "h1" else t for t in one_rank_plan()["transfers"]]), 1, "stage 2 receives h1 from a later stage 3"),
    ("a loss stage that is not there", _plan_with(loss_stage=9), 1, "the loss stage 9 is not a stage of the plan"),
    ("more processes than the plan's GPUs", toy_plan("two-ranks"), 1, "the plan is for 2 GPUs but 1 processes started"),
    ("fp16 under an asynchronous schedule", _plan_with(schedule="ftpipe", model={**one_rank_plan()["model"], "precision": "fp16", "compute_dtype": "float16"}), 1, "--dtype fp16 scales the loss by a factor all stages change together at their steps, and ftpipe does not step them together; use a synchronous schedule \\(gpipe, 1f1b, zb1p, zbv, interleaved\\), or bf16"),
    ("a package compiled for fp16 run in bf16", _plan_with(model={**one_rank_plan()["model"], "precision": "bf16", "compute_dtype": "float16"}), 1, "--dtype bf16: it was compiled for float16; compile it again with --dtype bf16"),
]  # fmt: skip


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _refused(plan, argv, code, message, tmp_path, capsys):
    before = _snapshot(tmp_path)
    with pytest.raises(SystemExit) as stopped, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        run(plan, STAGES, argv)
    err = capsys.readouterr().err
    said = (
        stopped.value.code if isinstance(stopped.value.code, str) else err.strip().split("\n")[-1]
    )
    assert (1 if isinstance(stopped.value.code, str) else stopped.value.code) == code, said
    assert "Traceback" not in err and "\n" not in said, said
    assert __import__("re").search(message, said), said
    assert "step 1/" not in err  # refused before training
    # nothing printed above the sentence (torch's warning about a foreign pickle, say)
    assert not [str(w.message) for w in warned], said
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("case, files, argv, code, message", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_and_files(case, files, argv, code, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, write in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write(tmp_path / name)
    (tmp_path / "log.json").write_text('{"an earlier": "log"}')  # must survive untouched
    _refused(one_rank_plan(), ["--steps", "2", *argv], code, message, tmp_path, capsys)


@pytest.mark.parametrize("case, plan, code, message", PLANS, ids=[c[0] for c in PLANS])
def test_bad_plans(case, plan, code, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")
    _refused(plan, ["--steps", "1"], code, message, tmp_path, capsys)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not valid JSON"),
        ("\x00\xff", "is not valid JSON"),
        (json.dumps({**one_rank_plan(), "format": 99}), "plan format 99 was written"),
    ],
)
def test_a_damaged_plan_file(text, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(text, errors="surrogateescape")
    _refused(str(tmp_path / "plan.json"), [], 1, message, tmp_path, capsys)
    _refused(
        str(tmp_path / "missing.json"),
        [],
        1,
        "the plan file .*missing.json does not exist",
        tmp_path,
        capsys,
    )


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A generated gpt2-tiny package (2 stages on 2 GPUs)."""
    pytest.importorskip("transformers")
    from ftpipe_compiler.codegen import generate_package
    from ftpipe_compiler.costs.profilers import costed_graph
    from ftpipe_compiler.partition import problem_from_graph, run_partitioners

    spec, _, traced, graph = costed_graph("gpt2-tiny")
    plan = run_partitioners(problem_from_graph(graph, 2), ["even-layers"], progress=False)[0].plan
    return generate_package(traced, graph, plan, spec, tmp_path_factory.mktemp("pkg"), "pytest")


@pytest.mark.parametrize("command", [["--steps", "1"], ["--check"]], ids=["train", "check"])
@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text: text[: len(text) // 2], "is not valid JSON \\(damaged or edited\\?"),
        (lambda text: text.replace('"format": 2', '"format": 7'), "plan format 7 was written"),
    ],
)
def test_a_package_with_a_damaged_plan_says_so_in_one_line(package, damage, message, command):
    """Training and `--check` read plan.json the same way (`topology.read_plan`)."""
    plan_file = package / "plan.json"
    good = plan_file.read_text()
    try:
        plan_file.write_text(damage(good))
        env = {"PYTHONPATH": RUNTIME_HOME, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-m", package.name, *command],
            cwd=package.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        plan_file.write_text(good)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert __import__("re").search(message, out.stderr), out.stderr


@pytest.fixture(scope="module")
def imported(package):
    """The generated package imported (its STAGES, and its plan's path)."""
    from ftpipe_runtime.stage.package import import_package

    return import_package(package)


def _weights(folder, imported, damage):
    """A $FTPIPE_WEIGHTS folder holding stage 0's tensors, then `damage(file)`."""
    from safetensors.torch import save_file

    folder.mkdir()
    stage = imported.STAGES[0](device="cpu")
    save_file({k: v.contiguous() for k, v in stage.state_dict().items()}, folder / "w.safetensors")
    damage(folder / "w.safetensors")


# (case, what is done to the weights file, what the one sentence says)
WEIGHTS = [
    ("cut short", lambda f: f.write_bytes(f.read_bytes()[:500]), "w.safetensors is not a readable safetensors file \\(Error while deserializing header.*\\); is it damaged or cut short\\?"),
    ("random bytes", lambda f: f.write_bytes(bytes(range(256)) * 8), "w.safetensors is not a readable safetensors file"),
    ("a folder without weights", lambda f: f.unlink(), "stage 0: \\$FTPIPE_WEIGHTS .* holds no \\*.safetensors weights"),
    ("a missing folder", lambda f: __import__("shutil").rmtree(f.parent), "stage 0: \\$FTPIPE_WEIGHTS .*weights holds no \\*.safetensors weights"),
]  # fmt: skip


@pytest.mark.parametrize("case, damage, message", WEIGHTS, ids=[c[0] for c in WEIGHTS])
def test_damaged_weights_are_one_sentence(case, damage, message, imported, tmp_path, monkeypatch):
    """$FTPIPE_WEIGHTS cut short or of random bytes was safetensors' raw SafetensorError; a
    folder without weights, or none, trained random weights without a word."""
    from ftpipe_runtime.errors import PipelineConfigError
    from ftpipe_runtime.job.check import main as check_main

    _weights(tmp_path / "weights", imported, damage)
    monkeypatch.setenv("FTPIPE_WEIGHTS", str(tmp_path / "weights"))
    with pytest.raises(PipelineConfigError) as refused:
        imported.STAGES[0](device="cpu")
    assert re.search(message, str(refused.value)), refused.value
    code = check_main([], imported.STAGES, imported.load_plan, prog="--check")  # the same
    assert code == 1


@pytest.mark.parametrize("command", ["export", "--save-hf"])
def test_an_export_never_replaces_a_folder_of_the_users_files(command, package, tmp_path, capsys):
    """An export is swapped in whole: into a folder holding the user's own files it deleted
    them. Refused before any work (a folder of an earlier export is still replaced)."""
    from ftpipe_runtime.job.cli import main

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's own notes")
    (tmp_path / "mine" / "config.json").write_text("{}")
    out = str(tmp_path / "mine")
    if command == "export":
        argv = ["export", "--checkpoint-dir", str(tmp_path / "ck"), "-o", out]
        assert main(argv, {}, package / "plan.json", package.name) == 1
        said = capsys.readouterr().err
    else:
        plan = json.loads((package / "plan.json").read_text())
        with pytest.raises(SystemExit) as stopped:
            run({**plan, "gpus": 1, "stages": [{**s, "gpu": 0} for s in plan["stages"]]},
                {}, ["--save-hf", out])  # fmt: skip
        said = str(stopped.value.code)
    assert re.search("mine holds files a model export does not write \\(notes.txt\\), which "
                     "replacing it would delete; give a new or empty folder", said), said  # fmt: skip
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's own notes"


def test_export_max_shard_size_is_checked(package, capsys):
    """--max-shard-size huge was transformers' raw ValueError, after the work."""
    from ftpipe_runtime.job.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["export", "-o", "x", "--max-shard-size", "huge"], {}, package / "plan.json", "p")
    assert stopped.value.code == 2
    assert (
        "argument --max-shard-size: 'huge' is not a size; give e.g. 5GB" in capsys.readouterr().err
    )


def test_sigterm_in_check_or_export_is_one_line_and_143(package, monkeypatch, capsys):
    from ftpipe_runtime.job import check
    from ftpipe_runtime.job.cli import main
    from ftpipe_runtime.job.signals import Terminated

    def terminated(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr(check, "check", terminated)
    assert main(["--check"], {}, package / "plan.json", package.name) == 143
    err = capsys.readouterr().err
    assert err == "ftpipe: stopped (SIGTERM); outputs that existed are unchanged\n"


def test_byte_order_marks_are_skipped(tmp_path, monkeypatch):
    """Notepad's UTF-8 files begin with a byte-order mark: a .jsonl of text was taken for
    token ids and refused, one of token ids failed on its first line."""
    from ftpipe_runtime.data.text import is_text_file

    bom = b"\xef\xbb\xbf"
    (tmp_path / "t.jsonl").write_bytes(bom + b'{"text": "one two"}\n')
    assert is_text_file(tmp_path / "t.jsonl")
    (tmp_path / "ids.jsonl").write_bytes(bom + b"".join(b"[1, 2, 3, 4, 5, 6]\n" for _ in range(8)))
    monkeypatch.chdir(tmp_path)
    summary = run(one_rank_plan(), STAGES, ["--steps", "1", "--data", "ids.jsonl"])
    assert len(summary["losses"]) == 1


def test_a_manifest_of_the_wrong_types_is_a_damaged_checkpoint(tmp_path, monkeypatch, capsys):
    """A manifest whose `files` is no mapping (edited by hand) was an AttributeError on
    --resume; it is a damaged checkpoint, and the run resumes from the one before."""
    monkeypatch.chdir(tmp_path)
    argv = ["--save-every", "1", "--checkpoint-dir", "ck"]
    run(one_rank_plan(), STAGES, [*argv, "--steps", "2"])
    manifest = tmp_path / "ck" / "step-000002" / "rank-0.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": "many"}))
    capsys.readouterr()
    run(one_rank_plan(), STAGES, [*argv, "--steps", "3", "--resume"])
    err = capsys.readouterr().err
    assert "warning: checkpoint ck/step-000002 is damaged (rank-0.json is not this " in err
    assert "resuming from step 1" in err
