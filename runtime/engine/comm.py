"""Messages between ranks: point-to-point transfers in a fixed order, and the few collectives.

    init_distributed(rank, world, "cpu", live.pg_store, backstop(hang_s))
    comm = Comm(gpu, gpus, device, backstop_s, flow, spec_of, replicas, replica)
    comm.send(1, ("act", "add_7", 3), tensor)      # non-blocking
    x = comm.recv(0, ("act", "add_7", 3))           # waits while rank 0 lives, else PeerFailure
    work = comm.all_reduce_async(flat, ranks)       # gradient buckets with the replicas
    work = comm.reduce_scatter_async(out, flat, ranks)   # sharded state (train.zero): 1/d each
    work = comm.all_gather_async(out, shard, ranks)      # ... and the shards back to everyone

Ranks in `send`, `recv` and `all_reduce` are the pipeline's GPUs (`rank`, `world`: this
process's GPU and the pipeline's GPU count); with data parallelism (`replicas`, a
`ftpipe_runtime.train.replicas.Replicas`) each replica's GPU g is a different process, and Comm
turns pipeline GPUs into the job's ranks. Every ordered pair of a replica's GPUs gets its
own process group, used in one direction only, and the receiver posts its receives in the
order the sender sends (`Dataflow.keys`). NCCL matches point-to-point messages by order
within a communicator and serialises a pair's sends and receives on one stream, so mixing
directions or orders could deadlock; gloo would also match by tag, which we set to the
message's position all the same.

Receives are posted ahead of need: from the start, and after each receive, every source's
next messages are posted until `ahead_bytes` of buffers per source wait (one more if that
falls short of the next message), and at most `POST_AHEAD_MESSAGES` of them: small messages
would otherwise fill a byte window with thousands of receives, whose buffers and key
derivation would make start-up grow with the run's length. Gloo and NCCL move a message once its receive is posted,
so a message posted ahead arrives while this rank computes instead of when it asks for it;
the window bounds the memory that costs (`--post-ahead` MB).

No wait has a deadline of its own: a receive posted long before its send may wait as long
as its sender lives and progresses (`ftpipe_runtime.job.liveness` decides that a peer is gone,
and ends a waiting rank then); the process groups' timeout (`timeout_s`) is a backstop.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..errors import PeerFailure
from ..job import liveness
from .dataflow import Dataflow, Key

POST_AHEAD_BYTES = 256 * 2**20  # per source: buffers of messages posted before they are needed
POST_AHEAD_MESSAGES = 64  # per source: a few steps of any plan's messages


def init_distributed(rank: int, world: int, device: str, store, timeout: timedelta) -> None:
    """The default process group on `store` (the liveness store's, after the ranks met), with
    `timeout` its own deadline: a backstop (`liveness.backstop`), since liveness decides."""
    if world == 1 or dist.is_initialized():
        return
    try:
        with liveness.waiting("connecting to the other ranks"):
            dist.init_process_group(
                _BACKENDS[device][0], store=store, rank=rank, world_size=world, timeout=timeout
            )
    except PeerFailure:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to connect means a peer is gone
        raise liveness.failure(f"rank {rank} could not connect to the other ranks", e) from e


def describe(key: Key) -> str:
    kind, name, index = key
    if kind == "eval":  # an activation, or a weight for a whole round from its first batch
        return f"{name!r} of evaluation batch {index}"
    if kind == "weight":
        return f"weight {name!r} after {index} steps of its stage"
    if kind == "wgrad":
        return f"gradient of weight {name!r} summed over step {index}"
    what = "activation" if kind == "act" else "gradient"
    return f"{what} {name!r} of micro-batch {index}"


class _Sent(NamedTuple):
    number: int  # the rank's sends, counted
    work: object
    tensor: torch.Tensor  # held until delivered
    dst: int
    key: Key


class Comm:
    """This rank's messages; `timeout_s` is the process groups' own deadline, a backstop
    (`liveness.backstop`: liveness decides that a peer is gone)."""

    def __init__(
        self,
        rank: int,
        world: int,
        device,
        timeout_s: float,
        flow: Dataflow,
        spec_of,
        replicas=None,
        replica: int = 0,
        ahead_bytes: int = POST_AHEAD_BYTES,
    ):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.ahead_bytes = ahead_bytes
        self.waited = 0.0  # seconds spent in `wait`
        self.timeout = timedelta(seconds=timeout_s)
        self.flow, self.spec_of = flow, spec_of
        self.replicas, self.replica = replicas, replica
        # The job's rank of each GPU of every replica's pipeline (one replica: the GPU itself).
        self.pipelines = (
            [replicas.pipeline(r) for r in range(replicas.count)] if replicas else [range(world)]
        )
        self.ranks = self.pipelines[replica]
        self.global_rank = self.ranks[rank]
        self.world_size = sum(len(p) for p in self.pipelines)
        self.pair_groups: dict[tuple[int, int], object] = {}
        self.groups: dict[tuple[int, ...], object] = {}
        peers = [pair for pair in flow.peers() if rank in pair]
        self._keys = {pair: flow.keys(*pair) for pair in peers}  # made as they are needed
        self._next_post = {src: 0 for src, dst in peers if dst == rank}
        self._next_send = {dst: 0 for src, dst in peers if src == rank}
        self._posted: dict[tuple[int, Key], tuple] = {}
        self._waiting = dict.fromkeys(self._next_post, 0)  # source -> bytes posted, not taken
        self._pending = dict.fromkeys(self._next_post, 0)  # source -> receives posted, not taken
        # Sends not yet known delivered: gloo reports one complete only once waited for.
        self._sends: list[_Sent] = []
        self._numbered = 0
        self._settled = 0  # sends made before the last settle (asynchronous schedules)
        self._stepped = (None, 0)  # (step, this rank's S actions of it so far)
        self._local_stages = len(flow.topo.stages_on(rank))
        self.sent: dict[str, list[int]] = {}  # message kind -> [messages, bytes] sent
        self.loss_groups: dict[int, object] = {}  # job rank of a loss stage -> its group with 0
        self.listener_error: Exception | None = None

    def make_groups(self, rank_sets, loss_rank: int, job_sets=()) -> None:
        """Create every process group, in one order on every rank (new_group is collective):
        each replica's pairs and `rank_sets` (GPUs of a pipeline), `job_sets` (job ranks:
        the replicas of a GPU), and a loss channel from each replica's loss GPU to rank 0."""
        if self.world_size == 1:
            return
        what = "creating the process groups with the other ranks"
        try:
            with liveness.waiting(what):
                self._make_groups(rank_sets, loss_rank, job_sets)
        except PeerFailure:
            raise
        except RuntimeError as e:  # torch.distributed's errors: a peer went meanwhile
            raise liveness.failure(f"gave up {what}", e) from e

    def _make_groups(self, rank_sets, loss_rank: int, job_sets) -> None:
        t = self.timeout
        for r, ranks in enumerate(self.pipelines):
            for src, dst in self.flow.peers():
                group = dist.new_group(sorted({ranks[src], ranks[dst]}), timeout=t)
                if r == self.replica:
                    self.pair_groups[(src, dst)] = group
        sets = {tuple(sorted(p[x] for x in s)) for p in self.pipelines for s in rank_sets}
        sets |= {tuple(sorted(s)) for s in job_sets}
        for ranks in sorted(s for s in sets if len(s) > 1):
            self.groups[ranks] = dist.new_group(list(ranks), timeout=t)
        for ranks in self.pipelines:
            if ranks[loss_rank] != 0:
                group = dist.new_group([0, ranks[loss_rank]], timeout=t)
                self.loss_groups[ranks[loss_rank]] = group
        self._connect()  # needed by NCCL, harmless (and so tested) on gloo
        self.post_ahead()

    def _connect(self) -> None:
        """Open every NCCL point-to-point channel now, pair by pair in one global order (of
        job ranks). NCCL opens one on its first message and blocks the sender until the
        receiver comes; opened mid-run, a send waiting for a peer that itself waits
        elsewhere could deadlock."""
        pairs = [((self.ranks[s], self.ranks[d]), g) for (s, d), g in self.pair_groups.items()]
        pairs += [((src, 0), g) for src, g in self.loss_groups.items()]
        token = torch.zeros(1, device=self.device)
        for (src, dst), group in sorted(pairs, key=lambda x: x[0]):
            if self.global_rank == src:
                dist.send(token, dst=dst, group=group)
            elif self.global_rank == dst:
                dist.recv(token, src=src, group=group)

    # --- the per-step losses and evaluation results, from the loss stages to rank 0 ---
    def send_loss(self, tag: int, message: torch.Tensor) -> None:
        group = self.loss_groups[self.global_rank]
        work = _post(
            lambda: dist.isend(message, dst=0, group=group, tag=tag),
            lambda: "sending a loss to rank 0",
        )
        self._keep_sent(work, message, 0, ("loss", "", tag))

    def listen_losses(self, messages) -> threading.Thread:
        """Receive `messages`, (src, tag, size, callback) with `src` a job rank, in the order
        given (each source's in the order it sends them), in a thread, calling
        `callback(message)` for each. A thread, because a posted gloo receive reports
        completion only to `wait`."""

        def loop():
            try:
                if self.device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(self.device)
                for src, tag, size, callback in messages:
                    buf = torch.empty(size, dtype=torch.float64, device=self.device)
                    dist.irecv(buf, src=src, group=self.loss_groups[src], tag=tag).wait()
                    callback(buf)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                self.listener_error = e

        thread = threading.Thread(target=loop, name="ftpipe-losses", daemon=True)
        thread.start()
        return thread

    # --- point to point ---
    def send(self, dst: int, key: Key, tensor: torch.Tensor) -> None:
        i = self._next_send[dst]
        due = self._keys[(self.rank, dst)].get(i)
        if due != key:
            raise RuntimeError(f"rank {self.rank} sends {key} to rank {dst}, but {due} is due")
        self._next_send[dst] = i + 1
        t = tensor.detach().contiguous()  # gloo refuses strided views
        count = self.sent.setdefault(key[0], [0, 0])
        count[0], count[1] = count[0] + 1, count[1] + t.nbytes
        group = self.pair_groups[(self.rank, dst)]
        work = _post(
            lambda: dist.isend(t, dst=self.ranks[dst], group=group, tag=i),
            lambda: f"sending {describe(key)} to rank {dst}",
        )
        self._keep_sent(work, t, dst, key)

    def recv(self, src: int, key: Key) -> torch.Tensor:
        if (src, key) not in self._posted:
            self._post_until(src, key)
        work, buf = self._posted.pop((src, key))
        self._waiting[src] -= buf.nbytes
        self._pending[src] -= 1
        self.post_ahead(src)
        self.wait(work, f"waiting for {describe(key)} from rank {src}")
        return buf

    def post_ahead(self, src: int | None = None) -> None:
        """Post the next receives from `src` (every source: None) up to the window."""
        for s in self._next_post if src is None else (src,):
            while (
                self._waiting[s] < self.ahead_bytes
                and self._pending[s] < POST_AHEAD_MESSAGES
                and self._post_next(s) is not None
            ):
                pass

    def _post_until(self, src: int, key: Key) -> None:
        while (k := self._post_next(src)) is not None:
            if k == key:
                return
        raise RuntimeError(f"rank {src} never sends {key} to rank {self.rank}")

    def _post_next(self, src: int) -> Key | None:
        """Post the receive of `src`'s next message; its key, or None when no more come."""
        keys = self._keys.get((src, self.rank))
        i = self._next_post.get(src, 0)
        k = keys.get(i) if keys is not None else None
        if k is None:
            return None
        shape, dtype = self.spec_of(k)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        group = self.pair_groups[(src, self.rank)]
        work = _post(
            lambda: dist.irecv(buf, src=self.ranks[src], group=group, tag=i),
            lambda: f"waiting for {describe(k)} from rank {src}",
        )
        self._posted[(src, k)] = (work, buf)
        self._waiting[src] += buf.nbytes
        self._pending[src] += 1
        self._next_post[src] = i + 1
        return k

    def _keep_sent(self, work, tensor, dst: int, key: Key) -> None:
        """Hold a sent tensor until it is delivered; free those delivered already (NCCL says
        so; gloo only when waited for)."""
        self._let_go(lambda s: s.work.is_completed())
        self._sends.append(_Sent(self._numbered, work, tensor, dst, key))
        self._numbered += 1

    def _let_go(self, due) -> None:
        """Wait for the sends `due(sent)` picks and drop them (a peer that stopped is a
        PeerFailure); keep the rest."""
        pending = []
        for s in self._sends:
            if due(s):
                self.wait(s.work, f"sending {describe(s.key)} to rank {s.dst}")
            else:
                pending.append(s)
        self._sends = pending

    def settle(self, step: int) -> None:
        """At each optimizer step (S) of this rank, of `step`: wait for the sends whose
        receivers have taken them by now, or will without anything this rank does later, and
        drop them (held otherwise till the end on gloo: every tensor a run sent). Under a
        synchronous schedule, at the rank's last S of the step, every send so far: a flushed
        step's messages are all taken by their receivers' actions of that step (the weights
        sent at a step go in the next), so the wait ends as they arrive, and nothing a step
        sent (its activations, gradients, a tied weight's gradient summed over the step) is
        held through the next. Under an asynchronous one, at the rank's first S of the step,
        the sends made before its previous step: a rank more than a step ahead of its peer
        waits here for it."""
        last, n = self._stepped
        n = n + 1 if last == step else 1
        self._stepped = (step, n)
        if self.flow.synchronous:
            if n == self._local_stages:
                self._let_go(lambda s: True)
            return
        if n == 1:
            before, self._settled = self._settled, self._numbered
            self._let_go(lambda s: s.number < before)

    def finish(self) -> None:
        """Wait for every send to be delivered (a sender's buffers must outlive its sends)."""
        self._let_go(lambda s: True)

    # --- collectives ---
    def all_reduce(
        self, tensor: torch.Tensor, ranks, what: str, replicas: bool = False
    ) -> torch.Tensor:
        """Sum over `ranks` (GPUs of this replica's pipeline; with `replicas`, those GPUs of
        every replica) in place (a no-op on one)."""
        pipelines = self.pipelines if replicas else [self.ranks]
        ranks = tuple(sorted(p[r] for p in pipelines for r in ranks))
        if len(ranks) > 1:
            doing = f"summing {what} with ranks {list(ranks)} (one of them stopped)"
            group = self._group(ranks)
            work = _post(lambda: dist.all_reduce(tensor, group=group, async_op=True), lambda: doing)
            self.wait(work, doing)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, ranks: tuple[int, ...]):
        """Start summing `tensor` in place over job ranks `ranks`; `wait` for the result."""
        group = self._group(tuple(sorted(ranks)))
        self._count("grad all-reduce", 2 * (len(ranks) - 1) / len(ranks) * tensor.nbytes)
        return _post(
            lambda: dist.all_reduce(tensor, group=group, async_op=True),
            lambda: f"summing gradients with ranks {sorted(ranks)}",
        )

    def reduce_scatter_async(self, out: torch.Tensor, flat: torch.Tensor, ranks):
        """Start summing `flat` over job ranks `ranks`, each keeping in `out` its 1/d of the
        sum (the i-th of the sorted ranks: the i-th chunk); `wait` for it. NCCL has the
        collective. Gloo's (torch 2.13: ProcessGroupGloo::reduce_scatter_tensor_coalesced) is
        an all-reduce of the whole tensor and a copy of the chunk, which moves twice the bytes
        and saves nothing; here each rank sends chunk j to the j-th rank in one all-to-all
        and sums the d chunks it gets, in rank order: (d-1)/d of `flat` out and in, as a ring
        reduce-scatter moves."""
        ranks = tuple(sorted(ranks))
        group, d = self._group(ranks), len(ranks)
        self._count("grad reduce-scatter", (d - 1) / d * flat.nbytes)
        what = lambda: f"summing gradient shards with ranks {list(ranks)}"  # noqa: E731
        if self.device.type == "cuda":
            scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            return _post(lambda: scatter(out, flat, group=group, async_op=True), what)
        got = torch.empty_like(flat)
        work = _post(lambda: dist.all_to_all_single(got, flat, group=group, async_op=True), what)
        return _Summed(work, got.view(d, -1), out)

    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, ranks, kind="weights"):
        """Start gathering every rank's `shard` into `out` (the i-th of the sorted job ranks'
        at the i-th place) over `ranks`; `wait` for it. Gloo's all-gather is its own.
        `kind`: what is gathered (counted in `sent` as "<kind> all-gather")."""
        ranks = tuple(sorted(ranks))
        group, d = self._group(ranks), len(ranks)
        self._count(f"{kind} all-gather", (d - 1) * shard.nbytes)
        return _post(
            lambda: dist.all_gather_into_tensor(out, shard, group=group, async_op=True),
            lambda: f"gathering {kind} shards from ranks {list(ranks)}",
        )

    def _count(self, kind: str, sent: float) -> None:
        """A collective's bytes this rank sends, as its ring algorithm sends them (a trace
        reports them beside the messages: `sent`)."""
        count = self.sent.setdefault(kind, [0, 0])
        count[0], count[1] = count[0] + 1, count[1] + round(sent)

    def _group(self, ranks: tuple[int, ...]):
        if ranks not in self.groups and len(ranks) == self.world_size:
            self.groups[ranks] = dist.group.WORLD
        return self.groups[ranks]

    def wait(self, work, what: str) -> None:
        """Wait for `work` as long as the peers live (`liveness`); a peer that stopped is a
        PeerFailure. The seconds add up in `waited` (a trace tells an action's waits from
        its compute)."""
        t = time.perf_counter()
        try:
            with liveness.waiting(what):
                _BACKENDS[self.device.type][1](work)
        except PeerFailure:
            raise
        except Exception as e:  # noqa: BLE001 - gloo and NCCL raise several types
            raise liveness.failure(f"gave up {what}", e) from e
        finally:
            self.waited += time.perf_counter() - t


class _Summed:
    """Gloo's reduce-scatter (`Comm.reduce_scatter_async`): the all-to-all in flight, then
    the d chunks received summed into the rank's own (the receive buffer, the size of the
    flat gradients, lives until then)."""

    def __init__(self, work, got: torch.Tensor, out: torch.Tensor):
        self.work, self.got, self.out = work, got, out

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        self.work.wait()
        torch.sum(self.got, 0, out=self.out)


def _post(start, what):
    """`start()`, a transfer's start. Gloo refuses one at once on a pair whose peer has
    closed it, before any wait: that is the peer gone, named as a wait names it (`what()`,
    and the peer's own sentence: a peer's Ctrl-C is 130 here too), not an unexpected error
    (exit 1, when the peer stopped while this rank was between its waits)."""
    try:
        return start()
    except RuntimeError as e:
        raise liveness.failure(f"gave up {what()}", e) from e


def _block(work) -> None:
    """Gloo: wait in C++ (the watchdog ends the process if a peer goes meanwhile). Only a
    wait tells that a point-to-point message went (`is_completed` stays False until then),
    and a wait with a timeout that expires closes the pair for good (measured on torch 2.13:
    "Application timeout caused pair closure"), so no wait here is sliced."""
    work.wait()


def _poll(work) -> None:
    """NCCL: `wait` only orders the compute stream after the message, and a wait with a
    timeout may abort the communicator; the CPU polls until the message is there, as
    the rank used to block for it, where the watchdog sees it wait."""
    pause = 1e-5
    while not work.is_completed():
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    work.wait()


# Per device: the backend, and how the main thread waits for a message or a collective.
_BACKENDS = {"cpu": ("gloo", _block), "cuda": ("nccl", _poll)}
