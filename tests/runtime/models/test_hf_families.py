"""Any HuggingFace model of a known head, given as nothing but a folder (save_pretrained).

Ten families, tiny configs that keep what makes each one itself (grouped-query attention
and rotary embeddings; Mistral's and Gemma 2's sliding windows; Gemma 2's embedding scaling
and soft-capping; Qwen 2's attention biases; Phi-3's fused projections; tied and untied
heads; BART's learned positions; T5's relative ones; BERT's token types; Mixtral's experts,
stored one by one and fused as transformers loads them, and routed through transformers'
own custom op), random weights
written with `save_pretrained`. For each: `ftpipe compile --gpus 2` succeeds, the package's
`--check` gives the original model's loss and every gradient (rtol 1e-5), and the package
trains 3 steps on 2 processes under gpipe (losses equal to training the HuggingFace model in
one process) and under ftpipe (the first step equal; later ones follow the async rule). Five
more families are compiled and checked. ftpipe's code names none of them but mBART, whose
decoder start is the one family rule (`ftpipe_runtime.models.FAMILY_RULES`).

Cost (2 cores): the compiles run in this process; the checks run in one interpreter, each as
`python -m <pkg> --check` runs it (runpy); the twenty trainings run in one
`torchrun --nproc_per_node 2`, each as `-m <pkg>` runs it, with its own rendezvous.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from runtime_helpers import RUNTIME_HOME
from runtime_reference import train_plain
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from ftpipe_runtime.models import with_dropout  # noqa: E402
from ftpipe_runtime.models.hf import build_model  # noqa: E402
from runtime_helpers import plan_json  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DECODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
)  # fmt: skip
ENC_DEC = dict(
    d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
    max_position_embeddings=64,
)  # fmt: skip
T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, vocab_size=128)
BERT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    vocab_size=128, max_position_embeddings=64,
)  # fmt: skip
FAMILIES = {  # model_type -> (class, config): compiled, checked and trained
    "llama": ("LlamaForCausalLM", dict(DECODER, tie_word_embeddings=False)),
    "mistral": ("MistralForCausalLM", dict(DECODER, sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", dict(DECODER, tie_word_embeddings=True)),
    "gemma2": ("Gemma2ForCausalLM", dict(DECODER, head_dim=8, sliding_window=8)),
    "phi3": ("Phi3ForCausalLM", dict(DECODER, pad_token_id=0)),
    "bart": ("BartForConditionalGeneration", ENC_DEC),
    "t5": ("T5ForConditionalGeneration", dict(T5, decoder_start_token_id=0)),
    "gpt2": (
        "GPT2LMHeadModel",
        dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64),
    ),
    "bert": ("BertForQuestionAnswering", BERT),
    # A mixture of experts: its checkpoint stores the experts one by one, which transformers
    # (and the stages, as they load) fuses; its routing counts tokens with a custom op
    "mixtral": ("MixtralForCausalLM", dict(DECODER, num_local_experts=4, num_experts_per_tok=2)),
}
MORE = {  # compiled and checked: QK norms, GPT-NeoX's checkpoint names (`embed_out`), OPT,
    # mBART's decoder start (its family rule), Pegasus's frozen sinusoidal positions
    "qwen3": ("Qwen3ForCausalLM", dict(DECODER, head_dim=8)),
    "gpt_neox": ("GPTNeoXForCausalLM", dict(DECODER, num_key_value_heads=4)),
    "opt": ("OPTForCausalLM", dict(DECODER, ffn_dim=64, word_embed_proj_dim=32)),
    "mbart": ("MBartForConditionalGeneration", ENC_DEC),
    "pegasus": ("PegasusForConditionalGeneration", ENC_DEC),
}
SEQ2SEQ = {"bart", "t5", "mbart", "pegasus"}
SCHEDULES = ("gpipe", "ftpipe")
STEPS, LR, CLIP = 3, 0.01, 1.0
TRAIN = ["--steps", str(STEPS), "--optimizer", "adamw", "--lr", str(LR), "--clip", str(CLIP)]


def _env() -> dict:
    path = os.pathsep.join(filter(None, [RUNTIME_HOME, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _save(folder: Path, model_type: str) -> None:
    cls, kwargs = {**FAMILIES, **MORE}[model_type]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    for key, value in with_dropout(config.to_dict(), 0.0).items():  # one process = many
        setattr(config, key, value)
    torch.manual_seed(0)
    getattr(transformers, cls)(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """model_type -> the package `ftpipe compile --model <folder> --gpus 2` wrote."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for model_type in {**FAMILIES, **MORE}:
        folder = root / "models" / model_type
        _save(folder, model_type)
        shape = ["--seq-len", "16", "--micro-batch", "2", "--batch", "4"]
        shape += ["--target-len", "4"] if model_type in SEQ2SEQ else []
        args = [
            "compile",
            "--model",
            str(folder),
            "--gpus",
            "2",
            *shape,
            "-o",
            str(root / model_type),
        ]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (model_type, result.output)
        out[model_type] = root / model_type / f"{model_type}_pipeline"
        assert out[model_type].is_dir(), result.output
    return out


def _run_in_one_interpreter(
    packages: dict, cwd: Path, runs: list[list[str]], torchrun: bool
) -> subprocess.CompletedProcess:
    """Run each argv (`<pkg> args...`) as `python -m` would (runpy), one after another, in
    one interpreter, or in each of the 2 processes of one torchrun."""
    script = cwd / ("train_all.py" if torchrun else "check_all.py")
    script.write_text(
        "import json, runpy, sys\n"
        f"for argv in json.loads({json.dumps(json.dumps(runs))}):\n"
        "    sys.argv = argv\n"
        "    print(f'=== {argv[0]}', flush=True)\n"
        "    try:\n"
        "        runpy.run_module(argv[0], run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        print(f'=== exit {e.code}', flush=True)\n"
    )
    cmd = [sys.executable, str(script)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(script)]  # fmt: skip
    found = [str(pkg.parent) for pkg in packages.values()]
    env = {**_env(), "PYTHONPATH": os.pathsep.join([*found, _env()["PYTHONPATH"]])}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def checks(packages) -> dict[str, dict]:
    """model_type -> the JSON `python -m <pkg> --check --json` prints."""
    cwd = next(iter(packages.values())).parents[1]
    runs = [[pkg.name, "--check", "--json"] for pkg in packages.values()]
    proc = _run_in_one_interpreter(packages, cwd, runs, torchrun=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = {}
    for part in proc.stdout.split("=== ")[1:]:
        head, _, rest = part.partition("\n")
        if head.endswith("_pipeline"):
            found[head.removesuffix("_pipeline")] = json.loads(rest[: rest.rindex("}") + 1])
    return found


@pytest.mark.parametrize("model_type", [*FAMILIES, *MORE])
def test_check_gives_the_original_loss_and_gradients(checks, model_type):
    result = checks[model_type]
    assert result["ok"], result
    assert result["loss_rel_diff"] <= 1e-5 and math.isfinite(result["reference_loss"])
    assert result["params_compared"] > 0


@pytest.fixture(scope="module")
def trained(packages) -> dict[tuple[str, str], dict]:
    """(model_type, schedule) -> the run's log: every package, both schedules, one torchrun."""
    cwd = next(iter(packages.values())).parents[1]
    runs = []
    for model_type in FAMILIES:
        for schedule in SCHEDULES:
            name = f"{model_type}-{schedule}"
            runs.append([packages[model_type].name, "--schedule", schedule, "--device", "cpu", *TRAIN,
                         "--init-method", f"file://{cwd / (name + '.store')}",
                         "--log-json", str(cwd / f"{name}.json")])  # fmt: skip
    proc = _run_in_one_interpreter(packages, cwd, runs, torchrun=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {
        (t, s): json.loads((cwd / f"{t}-{s}.json").read_text()) for t in FAMILIES for s in SCHEDULES
    }


def _train_in_one_process(pkg: Path) -> list[float]:
    """The HuggingFace model with the folder's weights, trained as the runtime does."""
    plan = plan_json(pkg / "plan.json")  # its model path resolved (relative to the package)
    model = plan["model"]
    net = build_model(model["config"], model["hf_class"], "cpu", dropout=0.0)
    net.load_state_dict(load_file(str(Path(model["path"]) / "model.safetensors")), strict=False)
    losses, _ = train_plain(plan, STEPS, "adamw", LR, CLIP, model=net)
    return losses


@pytest.mark.parametrize("model_type", FAMILIES)
def test_torchrun_trains_under_gpipe_and_ftpipe(packages, trained, model_type):
    reference = _train_in_one_process(packages[model_type])
    assert [trained[model_type, s]["schedule"] for s in SCHEDULES] == list(SCHEDULES)
    gpipe, ftpipe = (trained[model_type, s]["losses"] for s in SCHEDULES)
    assert gpipe == pytest.approx(reference, rel=1e-4)  # synchronous: the same training
    assert ftpipe[0] == pytest.approx(reference[0], rel=1e-5)  # async: stale from step 2
    assert len(ftpipe) == STEPS and all(math.isfinite(x) for x in ftpipe)
