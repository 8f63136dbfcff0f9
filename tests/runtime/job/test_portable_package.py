"""A compiled package holds no path of the machine that compiled it: copied elsewhere, it
finds the model's weights relative to itself, or from `--weights DIR`, and stops with one
sentence when it finds none (rather than train random weights)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from ftpipe_compiler.cli import cli  # noqa: E402
from ftpipe_compiler.model.zoo import resolve_model  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_a_copied_package_finds_its_weights_or_says_how(tmp_path, run_pipeline, monkeypatch):
    monkeypatch.delenv("FTPIPE_WEIGHTS", raising=False)
    model = tmp_path / "model"
    resolve_model("gpt2-tiny").build("cpu", dropout=0.0, seed=123).m.save_pretrained(model)
    out = tmp_path / "out"
    argv = ["compile", "--model", str(model), "--task", "tiny-lm", "--gpus", "2",
            "--schedule", "gpipe", "-p", "even-layers", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    pkg = out / "model_pipeline"
    for f in pkg.rglob("*"):
        if f.is_file():  # the compile machine's folders, in no file of the package
            assert str(tmp_path).encode() not in f.read_bytes(), f
    plan = json.loads((pkg / "plan.json").read_text())

    def train(where, name, extra=()):
        log = tmp_path / f"{name}.json"
        args = ["--steps", "2", "--log-json", str(log), *extra]
        codes, ranks = run_pipeline(plan, args, name=name, module=pkg.name, cwd=where)
        return codes, ranks, log

    codes, ranks, log = train(out, "here")  # beside its model: found relative to itself
    assert codes == [0, 0], ranks.stderr()
    here = json.loads(log.read_text())["losses"]

    far = tmp_path / "node2" / "job" / "packages"  # the model is not at ../../model from here
    shutil.copytree(pkg, far / pkg.name)
    codes, ranks, _ = train(far, "lost")
    assert codes == [1, 1], ranks.stderr()
    said = ranks.stderr(0)
    assert "pass --weights DIR" in said and "Traceback" not in said, said

    codes, ranks, log = train(far, "flag", ["--weights", str(model)])
    assert codes == [0, 0], ranks.stderr()
    assert json.loads(log.read_text())["losses"] == here  # the same weights, the same run

    # A folder without the weights is refused, never trained from random weights.
    (tmp_path / "empty").mkdir()
    codes, ranks, log = train(far, "random", ["--weights", str(tmp_path / "empty")])
    assert codes == [1, 1] and "holds no *.safetensors weights" in ranks.stderr(0)
