import json

import click
import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import COMMANDS, cli
from ftpipe_compiler.cli.options import FiniteFloatRange


def run(*args):
    return CliRunner().invoke(cli, list(args))


def commands():
    """Every command, loaded (cli.commands holds only those a test in this process ran)."""
    return {name: cli.get_command(None, name) for name in COMMANDS}


def test_help_and_models():
    assert run("--help").exit_code == 0
    r = run("models")
    assert r.exit_code == 0
    assert "t5-3b" in r.output and "rtx2080ti" in r.output and "rte" in r.output
    for shown in ("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "causal-lm", "rtx4090", "xsum"):
        assert shown in r.output
    data = json.loads(run("models", "--json").output)
    assert {m["name"] for m in data["models"]} >= {"t5-3b", "gpt2-xl", "bert-large", "t5-tiny"}
    assert {h["name"] for h in data["hardware"]} >= {"rtx3090", "l4", "a10g", "l40s", "a100-40gb"}


def test_profile_writes_graph_and_summary(tmp_path):
    out = tmp_path / "g.json"
    r = run("profile", "--model", "t5-tiny", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "nodes" in r.output and out.exists()
    r = run("profile", "--model", "gpt2-tiny", "--granularity", "layer", "--json")
    summary = json.loads(r.output)
    assert summary["parameters"] == 31_616 and summary["granularity"] == "layer"
    assert summary["forward_s"] > 0 and summary["backward_s"] > 0


def test_no_fuse_loss_keeps_the_models_own_head_and_loss(tmp_path):
    from ftpipe_compiler.graph.opgraph import OpGraph

    ops = {}
    for flag in ("--fuse-loss", "--no-fuse-loss"):
        out = tmp_path / f"{flag}.json"
        r = run("profile", "--model", "gpt2-tiny", flag, "-o", str(out))
        assert r.exit_code == 0, r.output
        ops[flag] = {n.op for n in OpGraph.load(out).nodes}
    fused = "ftpipe.linear_cross_entropy.default"
    assert fused in ops["--fuse-loss"] and fused not in ops["--no-fuse-loss"]
    assert any("cross_entropy" in op for op in ops["--no-fuse-loss"])


def test_errors_are_one_sentence_and_exit_1():
    cases = [
        (("profile", "--model", "t5-4b"), "unknown model 't5-4b'"),
        (("profile", "--model", "t5-tiny", "--task", "nope"), "unknown task 'nope'"),
        (("profile", "--model", "t5-tiny", "--task", "tiny-qa"), "for question-answering models"),
        (("profile", "--model", "zoo_fixtures:untraceable_model"), "torch.export could not trace"),
        (("profile", "--model", "llama-tiny", "--target-len", "4"), "is for seq2seq-lm models"),
        (("profile", "--model", "llama-tiny", "--seq-len", "100"), "has 64 positions"),
        (("profile", "--model", "nobody/nothing"), "`hf download nobody/nothing"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.exit_code == 1, (args, r.output)
        assert message in r.output
        assert "Traceback" not in r.output


def test_every_option_has_help_and_says_its_default():
    """`--help` of every command explains every option and what it is when not given."""
    for name, command in commands().items():
        for p in command.params:
            if not isinstance(p, click.Option) or p.name == "help":
                continue
            where = f"ftpipe {name} {p.opts[0]}"
            assert p.help, where
            if p.required or (p.is_flag and not p.secondary_opts):
                continue  # nothing to default to / off unless given
            if p.default is None:
                assert "default" in p.help, where  # in words: what happens without it
            else:
                assert p.show_default, where
        shown = run(name, "--help").output  # (simulate's defaults are all said in words)
        assert "[default: " in shown or "(default: " in shown or name == "models", name


def test_every_float_option_refuses_nan_and_inf():
    """nan passes every range check (its comparisons are all False) and inf every open one:
    each ended deep in the work as an "unexpected error"; every float option refuses both."""
    for name, command in commands().items():
        for p in command.params:
            if isinstance(p.type, click.types.FloatParamType):
                assert isinstance(p.type, FiniteFloatRange), f"ftpipe {name} {p.opts[0]}"
                for bad in ("nan", "inf", "-inf"):
                    with pytest.raises(click.BadParameter, match="is not a finite number"):
                        p.type.convert(bad, p, None)


def test_usage_errors_exit_2():
    """A value no option takes is a usage error: exit 2 and what to choose from."""
    cases = [
        (("profile", "-m", "t5-tiny", "--hardware", "tpu"), "unknown hardware 'tpu'; choose from"),
        (("compile", "-m", "gpt2-tiny", "-g", "2", "-p", "nope"), "unknown partitioner 'nope'"),
        (("compile", "-m", "gpt2-tiny"), "Missing option '--gpus'"),
        (("compile", "-m", "gpt2-tiny", "-g", "2", "--dtype", "fp8"), "'fp8' is not one of"),
        (("compile", "-m", "gpt2-tiny", "-g", "2", "--nope"), "No such option '--nope'"),
        (("simulate",), "give a plan file"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.exit_code == 2 and message in r.output, (args, r.output)
        assert "Traceback" not in r.output


def test_the_default_hardware_is_the_local_gpu_or_a_current_one():
    from ftpipe_compiler.cli.hardware import DEFAULT, hardware_for

    assert DEFAULT == "rtx4090"
    assert hardware_for("NVIDIA GeForce RTX 4090", 25_393_692_672) == "rtx4090"
    assert hardware_for("NVIDIA A100-SXM4-80GB", 85_100_000_000) == "a100-80gb"
    assert hardware_for("NVIDIA A100-PCIE-40GB", 42_300_000_000) == "a100-40gb"
    assert hardware_for("NVIDIA H100 80GB HBM3", 85_000_000_000) == "h100-80gb"
    assert hardware_for("NVIDIA L4", 23_700_000_000) == "l4"  # not l40s
    assert hardware_for("Tesla V100-SXM2-16GB", 16_900_000_000) is None  # no 16 GB V100 file
    assert hardware_for("NVIDIA RTX 5000 Ada Generation", 33_800_000_000) is None
    r = run("profile", "--model", "gpt2-tiny", "--json")
    import torch

    if not torch.cuda.is_available():  # this machine: the default
        assert json.loads(r.output)["hardware"] == DEFAULT


def test_head_and_shapes_from_the_command_line():
    r = run("profile", "--model", "bert-tiny", "--head", "masked-lm", "--seq-len", "8",
            "--micro-batch", "3", "--json")  # fmt: skip
    summary = json.loads(r.output)
    assert summary["task"] == "mlm@seq8" and summary["micro_batch"] == 3
    import torch
    import transformers

    from ftpipe_compiler.resources import load_config

    config = dict(load_config("models", "bert-tiny")["config"])
    config.pop("architectures")
    with torch.device("meta"):
        mlm = transformers.BertForMaskedLM(transformers.AutoConfig.for_model(**config))
    assert summary["parameters"] == sum(p.numel() for p in mlm.parameters())  # not the QA head's
    r = run("compile", "--model", "t5-tiny", "--gpus", "2", "--batch", "8", "--micro-batches", "3")
    assert r.exit_code == 2 and "--batch 8 is not --micro-batches 3" in r.output
