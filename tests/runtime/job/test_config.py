"""The run's settings: every option of the package's command line in one typed record."""

from __future__ import annotations

import dataclasses

import pytest
from ftpipe_runtime.job.config import CheckConfig, ExportConfig, RunConfig
from ftpipe_runtime.job.options import parse_args, parser

PLAN = {"model": {"lr": 0.01, "optimizer": "adam"}, "schedule": "1f1b", "micro_batches": 4}


def test_every_option_is_a_field_and_every_field_an_option():
    dests = {a.dest for a in parser(PLAN)._actions if a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(RunConfig)}


def test_parsed_once_typed_and_frozen():
    config = parse_args(
        ["--steps", "7", "--freeze-at", "3:1", "--adam-beta2", "0.95", "-v", "-v"], PLAN
    )
    assert isinstance(config, RunConfig)
    assert config.steps == 7 and config.lr == 0.01 and config.optimizer == "adam"
    assert config.freeze_at == ((3, 1),) and config.hyper.betas == (0.9, 0.95)
    assert config.loudness == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 8
    assert config.with_steps(9).steps == 9 and config.steps == 7


def test_the_learning_rate_is_the_schedules():
    config = parse_args(["--steps", "10", "--warmup", "2", "--decay", "linear"], PLAN)
    # transformers' linear schedule with warm-up: k/W during warm-up, then (N-k)/(N-W)
    assert [round(config.lr_at(k) / 0.01, 6) for k in (0, 1, 2, 6, 9)] == [
        0.0, 0.5, 1.0, 0.5, 0.125,
    ]  # fmt: skip
    assert config.lr_at(2, steps=6) == pytest.approx(0.01)


def test_the_export_and_check_command_lines_are_typed_records_too():
    """`export` and `--check` read their options as `ExportConfig` / `CheckConfig`, with the
    defaults and usage errors (exit 2) their parsers always had."""
    config = ExportConfig.parse(["-o", "out"])
    assert config == ExportConfig(output="out")
    assert (config.checkpoint_dir, config.step, config.tokenizer, config.chat_template) == (
        (None,) * 4
    )
    assert config.max_shard_size == 5 * 10**9 and config.merge_lora is False  # 5GB
    given = ExportConfig.parse(
        ["--step", "3", "-o", "o", "--max-shard-size", "2MB", "--merge-lora"]
    )
    assert (given.step, given.max_shard_size, given.merge_lora) == (3, 2_000_000, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.step = 4
    assert CheckConfig.parse([]) == CheckConfig(seed=0, json=False)
    assert CheckConfig.parse(["--seed", "7", "--json"]) == CheckConfig(seed=7, json=True)
    for parse, argv in [(ExportConfig.parse, []), (ExportConfig.parse, ["-o", "o", "--step", "x"]),
                        (CheckConfig.parse, ["--seed", "one"])]:  # fmt: skip
        with pytest.raises(SystemExit) as usage:
            parse(argv)
        assert usage.value.code == 2
