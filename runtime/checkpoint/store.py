"""Checkpoints: each stage's parameters and optimizer state and each rank's RNG, tied to the
run that made them.

    ckpt = Checkpoints(root, rank, world, run=run_identity(plan, args, schedule, m), keep=3)
    ckpt.refuse_foreign()                             # a new run: the folder holds no other run
    ckpt.start(manifest, agree, replace=False)        # the run's id: rank 0's, or the resumed one's
    ckpt.save_stage(4, stage_id, module, optimizer)   # root/step-000004/stage-2.safetensors
    ckpt.finish_rank(4, next_micro_batch=4 * m)        # rank-1.pt (RNG), then rank-1.json
    step = ckpt.choose(agree)                         # newest complete, intact, same run (or 0)
    ckpt.load_stage(step, stage_id, module, optimizer, device); ckpt.load_rank(step)
    ckpt.load_versions(step)                          # {(stage, version): weights} kept aside

One checkpoint is the folder `root/step-000004/`: `stage-<id>.safetensors` (a stage's
tensors: its fp32 master weights under mixed precision), `stage-<id>.optimizer.pt` (its
optimizer state), `rank-<r>.pt` (rank r's random-number generators and loss scale),
`versions-rank-<r>.safetensors` (older weight versions the next steps still use:
PipeDream-2BW's and WPipe's shadow weights) and `rank-<r>.json`, rank r's manifest, written
last: the run's identity, the data position, what was in flight (`"in_flight"`: the versions
kept, and whether the schedule drained its pipeline here; see `schedules.timeline`) and the
size and CRC-32 of each of that rank's files. The checkpoint is complete once every rank's
manifest exists. Every file is written atomically (`ftpipe_runtime.atomic`); loading never
unpickles anything but tensors and numbers (safetensors, `torch.load(weights_only=True)`).

A folder holds one run's checkpoints: each manifest names its run (`run_id`, made when the
run starts and kept by every resume of it), a new run refuses a folder holding another run's
(`refuse_foreign`) unless told to replace them (`start(replace=True)`:
--overwrite-checkpoints, which moves them into `replaced/` and removes them once its own
first checkpoint is complete), and a step whose manifests name two runs is no checkpoint.

`choose` resumes from the newest complete checkpoint whose files are intact on every rank
(one exchange between ranks per candidate); a damaged one is skipped with a warning. One
made by another run (another plan, schedule, seed, micro-batches, optimizer, data or
learning-rate settings) is refused, naming the difference. After each save only the newest
`keep` complete checkpoints stay.

A save a rank cannot finish (a full disk) gives its step up (`abandon`): a marker file
(`ABANDONED`) says so, every manifest goes, and the rank removes its own files. Never
another rank's, nor the folder under a rank still writing (that rank failed with "No
such file or directory", hiding the disk it was about to find full): each rank removes its
part on its way out (`leave`, also a rank stopped by its peer), and the last one out the
folder. A step no longer completable goes the same way: one a rank stopped in the middle
of, or one whose missing manifests belong to ranks that stopped. What a killed rank leaves
goes when the run resumes (`start`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import zlib
from pathlib import Path

import torch

from ..atomic import atomic_open, write_atomic
from ..errors import PipelineConfigError, WriteFailed
from .files import (
    FORMAT,
    STEP_DIR,
    Summing,
    default_dir,
    difference,
    load_pickled,
    new_run_id,
    on_host,
    plan_hash,
    read_tensors,
    run_identity,
    step_dir,
    tensor_bytes,
)

__all__ = [
    "Checkpoints",
    "default_dir",
    "plan_hash",
    "read_tensors",
    "run_identity",
    "step_dir",
    "tensor_bytes",
]

# Where --overwrite-checkpoints keeps the replaced run's checkpoints until its own first one is
# complete (inside the folder, where its user sees it: a rename, never a copy; `_steps` lists only
# step folders).
ASIDE = "replaced"
# In a step's folder: the step was given up and is no checkpoint (its ranks' parts go as
# each leaves). Not a step file: `complete` and the resume's clean-up read it.
ABANDONED = "abandoned"


class Checkpoints:
    def __init__(self, root, rank: int, world: int, run: dict, keep: int = 3, say=print):
        self.root, self.rank, self.world = Path(root), rank, world
        self.run, self.keep, self.say = run, keep, say
        self.run_id: str | None = None  # the run's name in its manifests (`start`)
        self._files: dict[int, dict[str, list[int]]] = {}  # step -> file -> [bytes, crc32]
        self._wrote: dict[int, set[str]] = {}  # step -> this rank's files there (to remove)
        self._replacing = False  # --overwrite-checkpoints: the old ones set aside until ours

    # --- writing ---
    def start(self, manifest: dict | None, agree=lambda x: [x], replace: bool = False) -> None:
        """Before the first save: the run's id, the resumed checkpoint's (`manifest`) or a new
        one, rank 0's (`agree`: an all_gather) so that every rank writes the same. With
        `replace` rank 0 moves every checkpoint in the folder aside (`ASIDE`; the other ranks
        save only after the ranks' next barrier), removed once this run's first checkpoint
        is complete (`prune`): a replacing run stopped before then leaves the old ones
        whole. A resumed run's abandoned saves after its step go (a save cut short by a full
        disk or a kill: the run saves those steps again)."""
        self.run_id = agree((manifest or {}).get("run_id") or new_run_id())[0]
        self._replacing = replace
        if self.rank != 0:
            return
        for step in self._steps():  # what a killed rank left of a step given up
            if (step_dir(self.root, step) / ABANDONED).exists():
                self._remove(step)
        if not (replace or manifest):
            return
        if replace:
            self._set_aside()
            return
        done = {step for step, _ in self.complete()}
        for step in self._steps():
            if step > manifest["step"] and step not in done:
                self._remove(step)

    def _set_aside(self) -> None:
        """Every step folder into `ASIDE`. Where an earlier replacing run's are there already,
        that run stopped before its first checkpoint: what it left in the folder is partial
        and goes, the run it replaced stays aside."""
        aside, earlier = self.root / ASIDE, bool(self.aside())
        for step in self._steps():
            if earlier:
                self._remove(step)
                continue
            aside.mkdir(parents=True, exist_ok=True)
            step_dir(self.root, step).rename(step_dir(aside, step))

    def aside(self) -> list[int]:
        """Steps an --overwrite-checkpoints run set aside and has not yet replaced."""
        aside = self.root / ASIDE
        if not aside.is_dir():
            return []
        return sorted(int(m.group(1)) for d in aside.iterdir() if (m := STEP_DIR.fullmatch(d.name)))

    def _save(self, step: int, name: str, obj) -> None:
        """`obj` into the step's folder: a dict of tensors as safetensors, else torch.save."""
        folder = step_dir(self.root, step)
        if step not in self._files:  # rewriting a step: incomplete until the manifest is back
            (folder / f"rank-{self.rank}.json").unlink(missing_ok=True)
            self._files[step] = {}
        self._wrote.setdefault(step, set()).add(name)
        data = tensor_bytes(obj) if name.endswith(".safetensors") else None
        for attempt in range(3):
            # A peer that gave the step up removes the folder once it is empty: made again,
            # and once this rank's temporary is in it, nobody can remove it under the write.
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with atomic_open(folder / name, "wb", needs=len(data) if data else None) as f:
                    summed = Summing(f)
                    if data is not None:
                        summed.write(data)
                    else:
                        torch.save(obj, summed)
                break
            except (FileExistsError, WriteFailed) as e:  # (mkdir: there, then gone at once)
                gone = isinstance(e, FileExistsError) or isinstance(e.__cause__, FileNotFoundError)
                if attempt == 2 or not gone or folder.exists():
                    raise
        self._files[step][name] = [summed.size, summed.crc]

    def abandon(self, step: int) -> None:
        """Give the step up (a save this rank could not finish, or the run stops before the
        step can be complete): marked `ABANDONED`, every rank's manifest removed (it can never
        be complete), this rank's files removed; the folder goes with the last part in it.
        The checkpoints before it stay."""
        folder = step_dir(self.root, step)
        self._files.pop(step, None)
        with contextlib.suppress(OSError):
            (folder / ABANDONED).touch()
        _drop_manifests(folder)
        for name in self._wrote.pop(step, set()):
            with contextlib.suppress(OSError):
                (folder / name).unlink()
        with contextlib.suppress(OSError):
            if {p.name for p in folder.iterdir()} <= {ABANDONED}:
                (folder / ABANDONED).unlink(missing_ok=True)
                folder.rmdir()  # (fails where another rank wrote in between: its to remove)

    def leave(self, stopped: set[int]) -> None:
        """The run stops with an error (`stopped`: the ranks that write no more, this one
        among them): this rank's part of every step that can no longer be complete goes.
        Those are the steps given up, the ones it began and did not finish, and those whose
        missing manifests are all of stopped ranks."""
        done = {step for step, _ in self.complete()}
        for step in sorted(set(self._wrote) - done):
            folder = step_dir(self.root, step)
            missing = {r for r in range(self.world) if not (folder / f"rank-{r}.json").exists()}
            if (folder / ABANDONED).exists() or step in self._files or missing <= stopped:
                self.abandon(step)

    def save_stage(self, step: int, stage: int, module, optimizer, tensors=None) -> None:
        """The stage's tensors (`tensors`, else its state dict) as safetensors; its optimizer
        state beside them (tensors and numbers only: loaded with weights_only)."""
        tensors = tensors if tensors is not None else module.state_dict()
        copies = {
            k: v.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            for k, v in tensors.items()
        }
        self._save(step, f"stage-{stage}.safetensors", copies)
        if optimizer is not None:
            self._save(step, f"stage-{stage}.optimizer.pt", on_host(optimizer.state_dict()))

    def finish_rank(
        self,
        step: int,
        next_micro_batch: int,
        steps: int | None = None,
        state=None,
        versions: dict[int, dict[int, dict]] | None = None,
        drained: bool = False,
    ) -> None:
        """The rank's RNG and kept weight versions ({stage: {version: weights}}), then its
        manifest (last: it marks its part complete), then prune. `state`: small run state
        (fp16's loss scale)."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self._save(step, f"rank-{self.rank}.pt", {"cpu": torch.get_rng_state(), "cuda": cuda})
        versions = {s: kept for s, kept in (versions or {}).items() if kept}
        if versions:
            flat = {
                f"{s}.{v}.{name}": t.detach().to(
                    "cpu", copy=True, memory_format=torch.contiguous_format
                )
                for s, kept in versions.items()
                for v, params in kept.items()
                for name, t in params.items()
            }
            self._save(step, f"versions-rank-{self.rank}.safetensors", flat)
        manifest = {
            "kind": "ftpipe-checkpoint",
            "format": FORMAT,
            "step": step,
            "rank": self.rank,
            "world": self.world,
            "run": self.run,
            "run_id": self.run_id,
            "steps": steps,
            "next_micro_batch": next_micro_batch,  # where the data continues
            "in_flight": {
                "drained": drained,
                "weight_versions": {str(s): sorted(kept) for s, kept in versions.items()},
            },
            "state": state or {},  # small run state: fp16's loss scale
            "files": self._files.pop(step),
        }
        write_atomic(step_dir(self.root, step) / f"rank-{self.rank}.json", json.dumps(manifest))
        for saved in [s for s in self._wrote if s not in self._files]:
            folder = step_dir(self.root, saved)  # every rank's part there: none to give up
            if all((folder / f"rank-{r}.json").exists() for r in range(self.world)):
                del self._wrote[saved]
        self.prune()

    # --- reading ---
    def _steps(self) -> list[int]:
        found = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                m = STEP_DIR.fullmatch(d.name)
                if m and d.is_dir():
                    found.append(int(m.group(1)))
        return sorted(found, reverse=True)

    def _manifest(self, step: int, rank: int) -> dict | None:
        """A rank's manifest; None when absent, a string key "damaged" when unreadable."""
        path = step_dir(self.root, step) / f"rank-{rank}.json"
        try:
            m = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            return {"damaged": f"{path.name} is unreadable ({type(e).__name__})"}
        if not isinstance(m, dict) or m.get("kind") != "ftpipe-checkpoint":
            return {"damaged": f"{path.name} is not a checkpoint manifest"}
        if m.get("format") != FORMAT:
            return {"damaged": f"{path.name} has format {m.get('format')!r}, not {FORMAT}"}
        if m.get("step") != step or not _well_typed(m):  # edited, or another step's
            return {"damaged": f"{path.name} is not this step's manifest (a field edited?)"}
        return m

    def complete(self) -> list[tuple[int, list[dict]]]:
        """(step, every rank's manifest), newest first, for checkpoints all ranks finished."""
        out = []
        for step in self._steps():
            first = self._manifest(step, 0)
            if first is None or (step_dir(self.root, step) / ABANDONED).exists():
                continue
            world = first.get("world") if isinstance(first.get("world"), int) else self.world
            manifests = [first] + [self._manifest(step, r) for r in range(1, world)]
            if any(m is None for m in manifests):
                continue
            # Every rank's part of one run: a step rewritten by another, cut short, is none.
            if len({m.get("run_id") for m in manifests if "damaged" not in m}) <= 1:
                out.append((step, manifests))
        return out

    def _intact(self, manifests: list[dict]) -> str | None:
        """Why this rank's part is damaged, or None; reads this rank's files once."""
        damaged = [m["damaged"] for m in manifests if "damaged" in m]
        return damaged[0] if damaged else self._changed(manifests[self.rank])

    def damaged(self, manifests: list[dict]) -> str | None:
        """Why any rank's part is damaged, or None (reads every rank's files)."""
        damaged = [m["damaged"] for m in manifests if "damaged" in m]
        if damaged:
            return damaged[0]
        return next(filter(None, (self._changed(m) for m in manifests)), None)

    def _changed(self, manifest: dict) -> str | None:
        for name, (size, crc) in manifest.get("files", {}).items():
            path = step_dir(self.root, manifest["step"]) / name
            try:
                got, sum_ = path.stat().st_size, 0
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 24):
                        sum_ = zlib.crc32(chunk, sum_)
            except OSError as e:
                return f"{name}: {e.strerror}"
            if (got, sum_) != (size, crc):
                return f"{name} has changed since it was saved ({got:,} bytes, {size:,} saved)"
        return None

    def choose(self, agree=lambda x: [x]) -> tuple[int, dict | None]:
        """(step, this rank's manifest) to resume from, (0, None) when there is none.

        `agree(value)` returns every rank's value (an all_gather), so all ranks take the
        same step even when only one of them finds its files damaged."""
        candidates = self.complete()
        for step, manifests in candidates:
            if diff := self._foreign(manifests):
                raise PipelineConfigError(
                    f"{step_dir(self.root, step)} was saved by another run ({diff}); resume "
                    "with the same options, or choose another --checkpoint-dir"
                )
            reasons = agree(self._intact(manifests))
            bad = [(r, why) for r, why in enumerate(reasons) if why]
            if not bad:
                return step, manifests[self.rank]
            self.say(
                f"ftpipe: warning: checkpoint {step_dir(self.root, step)} is damaged "
                f"({bad[0][1]}, rank {bad[0][0]}); trying the one before"
            )
        if candidates:
            raise PipelineConfigError(
                f"every checkpoint in {self.root} is damaged; start afresh without --resume"
            )
        self._refuse_aside()
        return 0, None

    def _refuse_aside(self) -> None:
        """One sentence when checkpoints an --overwrite-checkpoints run set aside wait there."""
        steps = self.aside()
        if not steps:
            return
        raise PipelineConfigError(
            f"{self.root / ASIDE} holds {len(steps)} checkpoints of another run, which an "
            "--overwrite-checkpoints run set aside and stopped before its first checkpoint; "
            f"move them back into {self.root} to resume them, replace them with "
            "--overwrite-checkpoints, or choose another --checkpoint-dir"
        )

    def refuse_foreign(self) -> None:
        """A new run must not save among another run's checkpoints: it would overwrite them,
        and a resume would mix the two. Any step a rank finished saving is another run's."""
        self._refuse_aside()  # (beside them at most the partial saves of the run that stopped)
        held = [s for s in self._steps() if any(step_dir(self.root, s).glob("rank-*.json"))]
        if not held:
            return
        what = f"{len(held)} saved, the newest of step {held[0]}"
        diff = next(filter(None, (self._foreign(m) for _, m in self.complete())), None)
        resume = "" if diff else "continue it with --resume, "
        raise PipelineConfigError(
            f"{self.root} holds checkpoints of another run ({diff or what}); {resume}replace "
            "them with --overwrite-checkpoints, or choose another --checkpoint-dir"
        )

    def _foreign(self, manifests: list[dict]) -> str | None:
        """How the run that saved these differs from this one (None: the same run)."""
        run = next((m.get("run") for m in manifests if "run" in m), None)
        return difference(run, self.run) if isinstance(run, dict) else None

    def load_stage(
        self, step: int, stage: int, module, optimizer, device, load=None, state_device=None
    ) -> None:
        """Stage tensors into `module` (or through `load(tensors)`), then its optimizer state
        (onto `state_device` when given: the host, where it is offloaded)."""
        folder = step_dir(self.root, step)
        path = folder / f"stage-{stage}.safetensors"
        try:
            tensors = read_tensors(path, device)
            (load or module.load_state_dict)(tensors)
            extra = folder / f"stage-{stage}.optimizer.pt"
            if optimizer is not None and extra.is_file():
                where = state_device or device
                optimizer.load_state_dict(load_pickled(extra, where))
        except FileNotFoundError:
            raise PipelineConfigError(f"{folder} has no stage {stage}: another plan?") from None
        except (RuntimeError, KeyError, ValueError) as e:
            raise PipelineConfigError(f"{path} does not fit stage {stage} ({e})") from None

    def load_rank(self, step: int) -> None:
        path = step_dir(self.root, step) / f"rank-{self.rank}.pt"
        rng = load_pickled(path)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])

    def load_versions(self, step: int) -> dict[tuple[int, int], dict]:
        """{(stage, version): weights} this rank kept aside at `step` ({} when none)."""
        path = step_dir(self.root, step) / f"versions-rank-{self.rank}.safetensors"
        if not path.exists():
            return {}
        try:
            flat = read_tensors(path)
        except ValueError as e:
            raise PipelineConfigError(f"{path} is damaged ({e})") from None
        kept: dict[tuple[int, int], dict] = {}
        for key, t in flat.items():
            s, v, name = key.split(".", 2)  # "stage.version.parameter name"
            kept.setdefault((int(s), int(v)), {})[name] = t
        return kept

    # --- tidying ---
    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints (0: all); partial ones older than the
        newest complete one are abandoned saves: they go too. A replacing run's first
        complete checkpoint lets the ones it set aside go."""
        if not (self.keep or self._replacing):
            return
        complete = self.complete()
        if self._replacing and any(m[0].get("run_id") == self.run_id for _, m in complete):
            shutil.rmtree(self.root / ASIDE, ignore_errors=True)
            self._replacing = False
        if not self.keep:
            return
        done = [step for step, _ in complete]
        if not done:
            return
        for step in self._steps():
            if step not in done[: self.keep] and step < done[0]:
                self._remove(step)

    def _remove(self, step: int) -> None:
        """Manifests first, so a checkpoint being removed is never taken for a complete one."""
        folder = step_dir(self.root, step)
        _drop_manifests(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _drop_manifests(folder: Path) -> None:
    """Every rank's manifest in a step's folder: the step is no checkpoint from then on."""
    for manifest in folder.glob("rank-*.json"):
        with contextlib.suppress(OSError):
            manifest.unlink()


def _well_typed(m: dict) -> bool:
    """The manifest's fields a resume reads have their types: files as {name: [size, crc]}."""
    files = m.get("files", {})
    sized = all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
        for v in (files.values() if isinstance(files, dict) else [None])
    )
    return sized and isinstance(m.get("run", {}), dict) and isinstance(m.get("world", 1), int)
