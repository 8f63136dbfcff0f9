"""Fixtures for the measured profiler: a private profile cache, one thread, small models."""

from __future__ import annotations

import json

import pytest
import torch

from ftpipe_compiler.costs import blocks as measured_blocks
from ftpipe_compiler.costs.profilers import costed_graph

# A GPT-2 big enough that its layers take milliseconds (timer noise stays small) and varied
# enough in FLOPs (embeddings, layers, a small head) for a rank correlation to mean something.
GPT2_SMALL = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 512,
    "n_positions": 128,
    "n_embd": 256,
    "n_layer": 4,
    "n_head": 4,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never read or write the user's ~/.cache while testing."""
    folder = tmp_path / "profiles"
    monkeypatch.setenv("FTPIPE_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def one_thread():
    """Timing tests run on one thread: two OpenMP threads on two shared cores stall each
    other whenever another process runs, and then a block's time varies 30-fold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def timed_blocks(monkeypatch):
    """A list that grows by one block id each time a block is timed."""
    seen = []
    real = measured_blocks.time_block

    def counting(b, *args, **kwargs):
        seen.append(b.id)
        return real(b, *args, **kwargs)

    monkeypatch.setattr(measured_blocks, "time_block", counting)
    return seen


@pytest.fixture(scope="session")
def t5_tiny_layer():
    """t5-tiny traced on `meta`, as `ftpipe profile` does: (spec, task, traced, analytic graph)."""
    return costed_graph("t5-tiny", granularity="layer")


def _hf_folder(path, config: dict, weights: bool = False):
    """A local HuggingFace model folder; with weights, saved as safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        import transformers

        torch.manual_seed(1)
        cfg = transformers.AutoConfig.for_model(**config)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def gpt2_small(tmp_path_factory):
    """A GPT-2 folder with a config only: the profiler initialises the weights."""
    return _hf_folder(tmp_path_factory.mktemp("gpt2-small"), GPT2_SMALL)


@pytest.fixture(scope="session")
def gpt2_with_weights(tmp_path_factory):
    """A small GPT-2 folder with real weights in model.safetensors."""
    config = {**GPT2_SMALL, "n_embd": 64, "n_layer": 2, "n_positions": 32}
    return _hf_folder(tmp_path_factory.mktemp("gpt2-weights"), config, weights=True)
