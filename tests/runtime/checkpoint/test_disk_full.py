"""A full disk anywhere in a run ends in one sentence (what, where, the space there and needed,
what to do), removes what it began and leaves every earlier file byte-identical: a rank's
checkpoint (safetensors, and torch.save's own RuntimeError), the logs, the atomic writer's
files and folders. The real full disk is a small tmpfs (`disk_helpers`; skipped where
mounting is not allowed); the writer's handling of the errors libraries make of a full disk
is checked everywhere."""

from __future__ import annotations

import builtins
import errno
import importlib.util
import json
import os

import pytest
import torch
from ftpipe_runtime import atomic, run
from ftpipe_runtime.atomic import atomic_open, new_folder, write_failure
from ftpipe_runtime.errors import PipelineConfigError, WriteFailed
from runtime_reference import checkpoint_params
from runtime_toy import STAGES, one_rank_plan, toy_plan
from tiny_disk import fill, snapshot

OLD = b"the previous, good file"
BIG = {"w": torch.arange(200_000, dtype=torch.float32)}  # 800 kB


class _SmallDisk:
    """A file on a disk with `room` bytes left: a write past it fails as the kernel's does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_torch_saves_full_disk_is_a_failed_write(tmp_path, monkeypatch):
    """torch.save makes a full disk a `RuntimeError: [enforce fail ...] unexpected pos`: the
    writer still says it is the disk, and keeps the previous file."""
    target = tmp_path / "stage-0.optimizer.pt"
    target.write_bytes(OLD)
    monkeypatch.setattr(atomic, "open", lambda *a, **k: _SmallDisk(builtins.open(*a, **k), 4096),
                        raising=False)  # fmt: skip
    with pytest.raises(WriteFailed) as failed, atomic_open(target, "wb") as f:
        torch.save(BIG, f)
    said = str(failed.value)
    assert isinstance(failed.value.__cause__, OSError)  # what torch had turned into its error
    assert said.startswith(f"cannot write {target}: No space left on device (")
    assert " free there, at least " in said and "\n" not in said
    assert said.endswith(
        "needed); free some space or write elsewhere; the previous file is unchanged"
    )
    assert target.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_the_failed_write_behind_a_librarys_error(tmp_path):
    with pytest.raises(RuntimeError) as torch_error, open(tmp_path / "x.pt", "wb") as f:
        torch.save(BIG, _SmallDisk(f, 4096))
    assert write_failure(torch_error.value).errno == errno.ENOSPC
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with pytest.raises(SafetensorError) as missing:  # a real one: the folder is not there
        save_file(BIG, str(tmp_path / "no" / "such.safetensors"))
    assert write_failure(missing.value) is None  # a missing folder is no failed write
    # Its words for a full disk (safetensors 0.4-0.6), which only a full disk makes:
    full = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert write_failure(full).errno == errno.ENOSPC
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise PipelineConfigError("said otherwise on purpose") from None
    except PipelineConfigError as e:
        assert write_failure(e) is None


def test_a_real_full_disk_under_the_atomic_writer(tiny_disk):
    disk = tiny_disk("2m")
    target, out = disk / "stage-0.pt", disk / "model"
    target.write_bytes(OLD)
    out.mkdir()
    (out / "config.json").write_bytes(OLD)
    before = snapshot(disk)
    fill(disk)
    with (
        pytest.raises(WriteFailed, match="No space left on device"),
        atomic_open(target, "wb") as f,
    ):
        torch.save(BIG, f)  # a real RuntimeError from torch on the way
    from safetensors.torch import save_file

    with pytest.raises(WriteFailed) as failed, new_folder(out, needs=800_000) as tmp:
        save_file(BIG, str(tmp / "model.safetensors"))  # a real SafetensorError
    said = str(failed.value)
    assert said.startswith(f"cannot write {out}: No space left on device (0.0 B free there, ")
    assert said.endswith("781.2 KiB needed); free some space or write elsewhere; nothing changed")
    assert snapshot(disk) == before
    assert sorted(p.name for p in disk.iterdir()) == ["ballast", "model", "stage-0.pt"]


ARGV = ["--optimizer", "adamw", "--lr", "0.05", "--decay", "constant", "--save-every", "2"]


def test_a_full_disk_at_a_checkpoint_keeps_the_ones_before(tiny_disk, tmp_path):
    disk = tiny_disk()
    ck = disk / "ck"
    argv = [*ARGV, "--checkpoint-dir", str(ck)]
    run(one_rank_plan(), STAGES, [*argv, "--steps", "2"])
    before = snapshot(ck)
    ballast = fill(disk)
    with pytest.raises(SystemExit) as stopped:
        run(one_rank_plan(), STAGES, [*argv, "--steps", "4", "--resume"])
    said = str(stopped.value.code)
    assert said.startswith(f"ftpipe: cannot write {ck}/step-000004/") and "\n" not in said
    assert "No space left on device (0.0 B free there, " in said
    assert said.endswith(
        "; the checkpoint of step 4 is removed and the ones before it are intact (--resume "
        "continues from the newest)"
    )
    assert snapshot(ck) == before and sorted(p.name for p in ck.iterdir()) == ["step-000002"]
    ballast.unlink()  # space again: the run goes on from step 2, as if never stopped
    log = tmp_path / "resumed.json"
    resumed = run(
        one_rank_plan(), STAGES, [*argv, "--steps", "4", "--resume", "--log-json", str(log)]
    )
    whole = run(
        one_rank_plan(),
        STAGES,
        [*ARGV, "--steps", "4", "--checkpoint-dir", str(tmp_path / "whole")],
    )
    assert resumed["first_step"] == 2 and resumed["losses"] == whole["losses"][2:]
    for name, value in checkpoint_params(tmp_path / "whole", 4, range(4)).items():
        assert torch.equal(value, checkpoint_params(ck, 4, range(4))[name]), name


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_of_two_ranks(tiny_disk, run_pipeline):
    """Whichever rank meets the full disk says so; none prints a traceback; the checkpoint
    before is intact and nothing is left of the one given up (each rank removes its own part
    on its way out); a resume once there is space goes on from the one before."""
    disk = tiny_disk()
    ck = disk / "ck"
    plan, argv = toy_plan("two-ranks", "1f1b"), [*ARGV, "--checkpoint-dir", str(ck)]
    codes, ranks = run_pipeline(plan, [*argv, "--steps", "2"], name="first")
    assert codes == [0, 0], ranks.stderr()
    before = snapshot(ck)
    ballast = fill(disk)
    codes, ranks = run_pipeline(plan, [*argv, "--steps", "4", "--resume"], name="full")
    err = ranks.stderr()
    assert codes == [1, 1] and "Traceback" not in err, err
    assert "No space left on device" in err and "the checkpoint of step 4 is removed" in err, err
    # Each rank removed its part of step 4 on its way out, the last one the folder.
    assert snapshot(ck) == before and sorted(p.name for p in ck.iterdir()) == ["step-000002"]
    ballast.unlink()
    codes, ranks = run_pipeline(plan, [*argv, "--steps", "4", "--resume"], name="again")
    assert codes == [0, 0], ranks.stderr()
    assert "resuming from step 2" in ranks.stderr(0)
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000004"]


def test_a_full_disk_at_the_logs(tiny_disk, tmp_path):
    """--log-json at the end, and --log-dir (TensorBoard's files too) at the start."""
    disk = tiny_disk()
    log_json, log_dir = disk / "log.json", disk / "logs"
    run(
        one_rank_plan(),
        STAGES,
        ["--steps", "1", "--log-json", str(log_json), "--log-dir", str(log_dir)],
    )
    assert json.loads(log_json.read_text())["steps"] == 1
    before = snapshot(disk)
    fill(disk)
    with pytest.raises(SystemExit) as stopped:
        run(one_rank_plan(), STAGES, ["--steps", "1", "--log-json", str(log_json)])
    said = str(stopped.value.code)
    assert said.startswith(f"ftpipe: cannot write {log_json}: No space left on device (0.0 B ")
    assert said.endswith(
        "needed); free some space or write elsewhere; the previous file is unchanged"
    )
    if importlib.util.find_spec("tensorboard") is None:  # log.jsonl only: written as --log-json
        return
    with pytest.raises(SystemExit) as stopped:
        run(one_rank_plan(), STAGES, ["--steps", "1", "--log-dir", str(log_dir)])
    said = str(stopped.value.code)
    assert said == (
        f"ftpipe: cannot write {log_dir / 'tensorboard'}: No space left on device (0.0 B free "
        "there); free some space or write elsewhere"
    )
    assert snapshot(disk) == before
