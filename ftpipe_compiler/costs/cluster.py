"""The machines a plan runs on: GPUs in nodes, the links inside a node and the network between.

    cluster = get_cluster("v100-32gb", gpus=64)                  # nodes as the hardware file has them
    cluster = get_cluster("v100-32gb", gpus=64, gpus_per_node=4)  # another node size
    cluster = load_cluster("my-cluster.json", gpus=64)            # `--cluster FILE`
    cluster.nodes, cluster.node_of(rank), cluster.to_json(), Cluster.from_json(d)

A hardware file's `node` section describes the node the GPU usually comes in: GPUs per node,
the link between two GPUs of a node (its bandwidth is the file's `link_bandwidth` unless the
section gives one measured for collectives, as `cpu.json`'s gloo figure) and the
node's network interface, which every byte leaving the node shares. A cluster file says the
same for a cluster of one's own:

    {"gpu": "v100-32gb", "gpus_per_node": 8,
     "intra_node": {"name": "NVLink2", "bandwidth": 48e9, "latency_s": 1e-5},
     "inter_node": {"name": "4 x 100 Gb/s InfiniBand", "bandwidth": 4e10, "latency_s": 5e-6}}

Ranks fill nodes in order (rank r on node r // gpus_per_node), as `torchrun --nnodes N
--nproc_per_node G` numbers them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import FtpipeError
from ..resources import load_config
from .formulas import ring_s
from .hardware import Hardware, get_hardware

__all__ = ["Cluster", "Link", "get_cluster", "load_cluster"]


@dataclass(frozen=True)
class Link:
    """A link: bytes/s in each direction, and the fixed cost of one message on it.

    `allreduce_bandwidth`, where measured, is the bandwidth a ring all-reduce reaches by
    buffer size, as (bytes, bytes/s) points: on a host where the ranks reduce in memory, a
    buffer that fits in the caches moves faster than one that streams from DRAM (gloo on
    `cpu.json`'s machine: ~2.4 GB/s up to a few MB, ~1.9 GB/s from 16 MB), which one
    bandwidth cannot give at both ends. Between points the bandwidth is interpolated in
    log(size); outside them it is the nearest point's.
    """

    name: str
    bandwidth: float
    latency_s: float = 0.0
    allreduce_bandwidth: tuple[tuple[float, float], ...] = ()

    def allreduce_s(self, nbytes: float, replicas: int, passes: int = 2) -> float:
        """Seconds of a ring all-reduce of `nbytes` among `replicas` ranks over this link;
        `passes=1`: a reduce-scatter or an all-gather of them (`formulas.ring_s`)."""
        bandwidth = self.allreduce_bandwidth_at(nbytes)
        return ring_s(nbytes, replicas, bandwidth, self.latency_s, passes=passes)

    def allreduce_bandwidth_at(self, nbytes: float) -> float:
        points = self.allreduce_bandwidth
        if not points or nbytes <= 0:
            return self.bandwidth
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, w0), (b1, w1) in zip(points, points[1:]):
            if nbytes <= b1:
                f = math.log(nbytes / b0) / math.log(b1 / b0)
                return w0 + f * (w1 - w0)
        return points[-1][1]

    def to_json(self) -> dict:
        d = {"name": self.name, "bandwidth": self.bandwidth, "latency_s": self.latency_s}
        if self.allreduce_bandwidth:
            d["allreduce_bandwidth"] = [list(p) for p in self.allreduce_bandwidth]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Link:
        if not isinstance(d, dict) or "bandwidth" not in d:
            raise FtpipeError(f"a link needs a bandwidth in bytes/s, not {d!r:.80}")
        try:
            curve = tuple(sorted((float(b), float(w)) for b, w in d.get("allreduce_bandwidth", ())))
        except (TypeError, ValueError):
            curve = None
        if curve is None or any(not (b > 0 and w > 0) for b, w in curve):
            raise FtpipeError(
                f"link {d.get('name', '')!r}: allreduce_bandwidth must be a list of "
                "[bytes, bytes/s] pairs, both positive"
            )
        link = cls(
            str(d.get("name", "")),
            float(d["bandwidth"]),
            float(d.get("latency_s", 0.0)),
            curve,
        )
        if not link.bandwidth > 0 or link.latency_s < 0:
            raise FtpipeError(
                f"link {link.name!r}: bandwidth must be positive and latency not negative"
            )
        return link


@dataclass(frozen=True)
class Cluster:
    gpu: Hardware
    gpus: int  # in all
    gpus_per_node: int
    intra_node: Link  # between two GPUs of one node (each pair its own)
    inter_node: Link  # one node's network interface, shared by all its GPUs
    name: str = ""
    description: str = ""

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise FtpipeError(
                f"a cluster needs at least 1 GPU and 1 GPU per node, not {self.gpus} and "
                f"{self.gpus_per_node}"
            )

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def with_gpus(self, gpus: int) -> Cluster:
        return Cluster(
            self.gpu,
            gpus,
            self.gpus_per_node,
            self.intra_node,
            self.inter_node,
            self.name,
            self.description,
        )

    def describe(self) -> str:
        """`8 nodes x 8 v100-32gb, NVLink2 inside a node, 4 x 100 Gb/s InfiniBand between`"""
        nodes = f"{self.nodes} node{'s' * (self.nodes > 1)} x {min(self.gpus, self.gpus_per_node)}"
        return (
            f"{nodes} {self.gpu.name}, {self.intra_node.name or 'links'} "
            f"({self.intra_node.bandwidth / 1e9:g} GB/s) inside a node, "
            f"{self.inter_node.name or 'network'} ({self.inter_node.bandwidth / 1e9:g} GB/s) "
            "between nodes"
        )

    def to_json(self) -> dict:
        return {
            "kind": "ftpipe-cluster",
            "name": self.name,
            "description": self.description,
            "gpu": self.gpu.to_json(),
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "intra_node": self.intra_node.to_json(),
            "inter_node": self.inter_node.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict, gpus: int | None = None) -> Cluster:
        """A cluster from its JSON; `gpu` may be a hardware name or a whole hardware object,
        and `gpus` (the number asked for) replaces the file's own."""
        if not isinstance(d, dict):
            raise FtpipeError("a cluster must be a JSON object")
        missing = [k for k in ("gpu", "gpus_per_node", "intra_node", "inter_node") if k not in d]
        if missing:
            raise FtpipeError(f"the cluster description lacks {', '.join(missing)}")
        gpu = d["gpu"]
        hw = get_hardware(gpu) if isinstance(gpu, str) else Hardware.from_json(gpu)
        count = gpus if gpus is not None else d.get("gpus")
        if not isinstance(count, int):
            raise FtpipeError("say how many GPUs the cluster has (--gpus)")
        per_node = d["gpus_per_node"]
        if not isinstance(per_node, int) or isinstance(per_node, bool):
            raise FtpipeError(f"gpus_per_node must be a whole number, not {per_node!r}")
        return cls(
            hw,
            count,
            per_node,
            Link.from_json(d["intra_node"]),
            Link.from_json(d["inter_node"]),
            str(d.get("name", "")),
            str(d.get("description", "")),
        )


def get_cluster(hardware: str | Hardware, gpus: int, gpus_per_node: int | None = None) -> Cluster:
    """`gpus` of a hardware kind in the nodes its file describes (`gpus_per_node` replaces
    the file's). A hardware file without a node section is one node of all the GPUs."""
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    node = (load_config("hardware", hw.name) or {}).get("node") or {}
    intra = node.get("intra_node") or {}
    inter = node.get("inter_node") or {}
    per_node = gpus_per_node or node.get("gpus", gpus)
    return Cluster(
        hw,
        gpus,
        per_node,
        Link.from_json({"name": "link", "bandwidth": hw.link_bandwidth, **intra}),
        Link.from_json(inter)
        if inter
        else Link("none (one node)", hw.link_bandwidth, float(intra.get("latency_s", 0.0))),
        f"{hw.name} x {gpus}",
        node.get("description", ""),
    )


def load_cluster(path, gpus: int | None = None) -> Cluster:
    """`--cluster FILE`: a cluster description (see the module docstring)."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise FtpipeError(f"cannot read the cluster file {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FtpipeError(f"the cluster file {path} is not valid JSON") from None
    cluster = Cluster.from_json(d, gpus)
    return cluster if cluster.name else Cluster.from_json({**d, "name": Path(path).stem}, gpus)
