"""Cluster descriptions: nodes of GPUs, the link inside a node, the network between."""

from __future__ import annotations

import json

import pytest

from ftpipe_compiler.costs.cluster import Cluster, Link, get_cluster, load_cluster
from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.resources import config_names, load_config


def test_round_trip():
    c = get_cluster("v100-32gb", gpus=64)
    assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert Link.from_json(c.inter_node.to_json()) == c.inter_node


def test_allreduce_bandwidth_by_size():
    """A measured curve: the nearest point outside it, log-interpolated inside, the ring
    formula on top; a link without one uses its bandwidth for every size."""
    MB = 1e6
    link = Link("gloo", 1e9, 1e-5, ((1 * MB, 2.4e9), (16 * MB, 1.8e9)))
    assert link.allreduce_bandwidth_at(0.5 * MB) == 2.4e9
    assert link.allreduce_bandwidth_at(100 * MB) == 1.8e9
    assert link.allreduce_bandwidth_at(4 * MB) == pytest.approx(2.1e9)  # halfway in log size
    assert link.allreduce_s(4 * MB, 4) == pytest.approx(1.5 * 4 * MB / 2.1e9 + 6e-5)
    assert Link("plain", 1e9).allreduce_s(8 * MB, 2) == pytest.approx(8e-3)
    assert Link.from_json(json.loads(json.dumps(link.to_json()))) == link
    cpu = get_cluster("cpu", gpus=2).intra_node  # cpu.json stores this machine's gloo curve
    assert len(cpu.allreduce_bandwidth) >= 2


def test_hardware_files_describe_their_node():
    c = get_cluster("v100-32gb", gpus=64)
    assert (c.gpus_per_node, c.nodes) == (8, 8)
    assert c.intra_node.bandwidth == get_hardware("v100-32gb").link_bandwidth
    assert c.inter_node.bandwidth == 4 * 12.5e9 * 0.8  # four 100 Gb/s ports, 80 % of them
    assert [c.node_of(r) for r in (0, 7, 8, 63)] == [0, 0, 1, 7]
    assert get_cluster("v100-32gb", gpus=64, gpus_per_node=4).nodes == 16
    for name in config_names("hardware"):
        node = load_config("hardware", name)["node"]
        assert node["gpus"] >= 1 and node["inter_node"]["bandwidth"] > 0 and node["sources"]


def test_cluster_file(tmp_path):
    path = tmp_path / "lab.json"
    path.write_text(
        json.dumps(
            {
                "gpu": "rtx2080ti",
                "gpus_per_node": 4,
                "intra_node": {"name": "PCIe", "bandwidth": 10e9},
                "inter_node": {"name": "25 GbE", "bandwidth": 2.5e9, "latency_s": 2e-5},
            }
        )
    )
    c = load_cluster(path, gpus=16)
    assert (c.name, c.gpu.name, c.nodes, c.inter_node.latency_s) == ("lab", "rtx2080ti", 4, 2e-5)
    assert "4 nodes x 4 rtx2080ti" in c.describe()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ('{"gpu": "rtx2080ti"}', "lacks gpus_per_node, intra_node, inter_node"),
        (
            '{"gpu": "rtx2080ti", "gpus_per_node": 4, "intra_node": {"bandwidth": 1e9}, '
            '"inter_node": {"bandwidth": -1}}',
            "bandwidth must be positive",
        ),
        (
            '{"gpu": "nope", "gpus_per_node": 4, "intra_node": {"bandwidth": 1e9}, '
            '"inter_node": {"bandwidth": 1e9}}',
            "unknown hardware 'nope'",
        ),
        (
            '{"gpu": "cpu", "gpus_per_node": 0, "intra_node": {"bandwidth": 1e9}, '
            '"inter_node": {"bandwidth": 1e9}}',
            "and 1 GPU per node, not 8 and 0",
        ),
        (
            '{"gpu": "cpu", "gpus_per_node": 2, "intra_node": {"bandwidth": 1e9, '
            '"allreduce_bandwidth": [[1e6, 0]]}, "inter_node": {"bandwidth": 1e9}}',
            "allreduce_bandwidth must be a list of",
        ),
    ],
)
def test_bad_cluster_files(tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(FtpipeError, match=message):
        load_cluster(path, gpus=8)
