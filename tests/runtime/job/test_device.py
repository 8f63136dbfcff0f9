"""Where a rank computes and how: its GPU among those it sees, its CPU threads, TF32."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime.job import device as device_module
from ftpipe_runtime.job.device import pick_device, tf32_state, use_tf32
from ftpipe_runtime.job.options import parse_args
from ftpipe_runtime.job.ranks import Place
from runtime_toy import toy_plan


@pytest.fixture
def one_visible_gpu(monkeypatch):
    """A GPU rank as launchers that set CUDA_VISIBLE_DEVICES per process start it: rank 1
    of 2 on the node, one GPU visible; OMP_NUM_THREADS not set; 16 cores."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("device", d))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.setdefault("threads", n))
    monkeypatch.setattr(device_module.os, "cpu_count", lambda: 16)
    for k, v in {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return calls


def test_one_visible_gpu_is_cuda_0_and_the_cores_are_shared(one_visible_gpu):
    """`cuda:LOCAL_RANK` was cuda:1 here, a device this process cannot see; and a GPU rank's
    threads took every core, each of the node's ranks."""
    place = Place.of(toy_plan("two-ranks"), "cuda", 1)
    assert place.device == torch.device("cuda", 0)
    assert one_visible_gpu == {"device": torch.device("cuda", 0), "threads": 8}


def test_with_every_gpu_visible_the_local_rank_picks_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert pick_device("cuda", 3) == torch.device("cuda", 3)
    assert pick_device("cuda", 11) == torch.device("cuda", 3)  # a second group on the node
    assert pick_device("cpu", 3) == torch.device("cpu")


def test_omp_num_threads_is_left_to_decide(one_visible_gpu, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    Place.of(toy_plan("two-ranks"), "cuda", 1)
    assert "threads" not in one_visible_gpu


def test_tf32_is_on_by_default_and_can_be_turned_off():
    plan = toy_plan("two-ranks")
    assert parse_args([], plan).tf32 is True
    assert parse_args(["--no-tf32"], plan).tf32 is False


def test_a_cpu_rank_leaves_fp32_alone():
    before = tf32_state()
    use_tf32(torch.device("cpu"), True)
    assert tf32_state() == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_tf32_follows_the_option():
    before = torch.get_float32_matmul_precision()
    try:
        use_tf32(torch.device("cuda"), True)
        assert tf32_state() == {"matmul": "high", "cudnn": True}
        use_tf32(torch.device("cuda"), False)
        assert tf32_state() == {"matmul": "highest", "cudnn": False}
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = True
