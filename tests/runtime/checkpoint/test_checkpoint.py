"""Checkpoints: complete or ignored, tied to their run, damaged ones skipped, old ones pruned."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from ftpipe_runtime import run
from ftpipe_runtime.atomic import remove_temporaries
from ftpipe_runtime.checkpoint import store
from ftpipe_runtime.checkpoint.store import (
    ABANDONED,
    ASIDE,
    Checkpoints,
    default_dir,
    run_identity,
    step_dir,
)
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.train.optim import make_optimizer
from runtime_reference import checkpoint_params
from runtime_toy import STAGES, one_rank_plan, toy_plan

ARGS = argparse.Namespace(
    seed=0, data=None, optimizer="adam", lr=0.1, warmup=0, decay="linear", clip=1.0
)


def _identity(**changes):
    return run_identity(toy_plan(), argparse.Namespace(**{**vars(ARGS), **changes}), "gpipe", 4)


def _trained():
    module = torch.nn.Linear(3, 2)
    opt = make_optimizer("adam", module.parameters(), 0.1)
    module(torch.ones(1, 3)).sum().backward()
    opt.step()
    return module, opt


def _save(root, step, ranks, world=2, run=None, keep=0, module=None, opt=None):
    module, opt = (module, opt) if module is not None else _trained()
    for rank in ranks:
        ckpt = Checkpoints(root, rank, world, run or _identity(), keep)
        ckpt.save_stage(step, rank, module, opt)
        ckpt.finish_rank(step, next_micro_batch=4 * step)
    return module, opt


def test_checkpoints_are_complete_or_ignored(tmp_path):
    module, opt = _save(tmp_path, 2, ranks=(0, 1))
    _save(tmp_path, 4, ranks=(0,))  # rank 1 never finished step 4
    ckpt = Checkpoints(tmp_path, 1, 2, _identity())
    step, manifest = ckpt.choose()
    assert step == 2 and manifest["next_micro_batch"] == 8 and manifest["run"] == _identity()
    assert not list(tmp_path.rglob("*.tmp"))
    other = torch.nn.Linear(3, 2)
    other_opt = make_optimizer("adam", other.parameters(), 0.1)
    ckpt.load_stage(2, 1, other, other_opt, "cpu")
    assert torch.equal(other.weight, module.weight)
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(
        opt.state_dict()["state"][0]["exp_avg"]
    )


@pytest.mark.parametrize(
    "change, named",
    [
        ({"seed": 1}, "seed 0 there, 1 here"),
        ({"lr": 0.2}, "lr 0.1 there, 0.2 here"),
        ({"data": "copy"}, "data 'synthetic' there, 'copy' here"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, change, named):
    _save(tmp_path, 2, ranks=(0, 1))
    other = Checkpoints(tmp_path, 0, 2, _identity(**change))
    with pytest.raises(PipelineConfigError, match=f"saved by another run \\({named}\\)"):
        other.choose()
    with pytest.raises(PipelineConfigError, match=f"holds checkpoints of another run \\({named}"):
        other.refuse_foreign()  # a new run may not save among them either


def test_the_plan_and_schedule_are_part_of_the_identity(tmp_path):
    base = _identity()
    other_plan = toy_plan("three-ranks")
    assert run_identity(other_plan, ARGS, "gpipe", 4)["plan"] != base["plan"]
    assert run_identity(toy_plan(), ARGS, "1f1b", 4)["schedule"] == "1f1b"
    assert run_identity(toy_plan(), ARGS, "gpipe", 8)["micro_batches"] == 8
    # One folder per plan by default: two packages run from one place never share one.
    assert default_dir(toy_plan()) != default_dir(other_plan)
    assert default_dir(toy_plan()) == default_dir(toy_plan())


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    _save(tmp_path, 2, ranks=(0, 1))
    _save(tmp_path, 4, ranks=(0, 1))
    stage = step_dir(tmp_path, 4) / "stage-1.safetensors"
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different content
    stage.write_bytes(bytes(data))
    said = []
    # Rank 0's own files are intact; it learns from the exchange that rank 1's are not.
    rank0 = Checkpoints(tmp_path, 0, 2, _identity(), say=said.append)
    rank1 = Checkpoints(tmp_path, 1, 2, _identity())
    reason = rank1._intact(rank1.complete()[0][1])
    assert reason and "stage-1.safetensors has changed" in reason
    rank1_says = iter([reason, None])  # about step 4, then about step 2
    assert rank0.choose(agree=lambda mine: [mine, next(rank1_says)])[0] == 2
    assert (
        len(said) == 1
        and "step-000004 is damaged (stage-1.safetensors" in said[0]
        and "\n" not in said[0]
    )
    assert rank1.choose()[0] == 2
    stage.write_bytes(b"")
    (step_dir(tmp_path, 2) / "rank-0.json").write_text("{not json")
    with pytest.raises(PipelineConfigError, match="every checkpoint in .* is damaged"):
        rank1.choose()


def test_old_checkpoints_and_abandoned_saves_are_pruned(tmp_path):
    module, opt = _trained()
    _save(tmp_path, 1, ranks=(0,), module=module, opt=opt)  # abandoned: rank 1 never finished
    for step in (2, 4, 6):
        _save(tmp_path, step, ranks=(0, 1), keep=2, module=module, opt=opt)
    _save(tmp_path, 8, ranks=(0,), keep=2, module=module, opt=opt)  # in progress: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000004",
        "step-000006",
        "step-000008",
    ]
    _save(tmp_path, 8, ranks=(1,), keep=2, module=module, opt=opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000008"]


def _ranks(root, world=2):
    return [Checkpoints(root, r, world, _identity(), keep=0) for r in range(world)]


def test_a_step_given_up_goes_with_its_last_rank_out_never_under_a_writer(tmp_path):
    """Rank 1 gives step 2 up (a full disk) while rank 0 is in the middle of it: rank 0's
    files and the folder stay under it, the step is no checkpoint however rank 0 goes on,
    and rank 0's way out removes its part and the folder; step 1 stays whole."""
    module, opt = _save(tmp_path, 1, ranks=(0, 1))
    zero, one = _ranks(tmp_path)
    zero.save_stage(2, 0, module, opt)
    one.save_stage(2, 1, module, opt)
    one.abandon(2)
    folder = step_dir(tmp_path, 2)
    assert sorted(p.name for p in folder.iterdir()) == [
        ABANDONED,
        "stage-0.optimizer.pt",
        "stage-0.safetensors",
    ]
    zero.finish_rank(2, next_micro_batch=8)  # its save goes on: the step stays given up
    assert [s for s, _ in zero.complete()] == [1]
    one.leave({1})  # (nothing of rank 1's is left)
    zero.leave({0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
    assert Checkpoints(tmp_path, 0, 2, _identity()).choose()[0] == 1


@pytest.mark.parametrize("when", ["before its temporary", "in its mkdir"])
def test_a_save_makes_the_folder_again_when_a_peer_removed_it_under_it(tmp_path, monkeypatch, when):
    """The last part of a given-up step removed (and the folder with it) just before this
    rank writes there, or while its mkdir found the folder there: its write still lands, and
    its way out removes it."""
    module, opt = _trained()
    zero, one = _ranks(tmp_path)
    folder, removed = step_dir(tmp_path, 2), []
    folder.mkdir()  # rank 1's, which it gives up having written nothing there

    def peer_first(real, raises):
        def call(self_or_path, *args, **kwargs):
            if not removed and folder in (Path(self_or_path), Path(self_or_path).parent):
                removed.append(when)
                one.abandon(2)  # the emptied folder goes
                assert not folder.exists()
                if raises:
                    raise FileExistsError(17, "File exists", str(folder))
            return real(self_or_path, *args, **kwargs)

        return call

    if when == "in its mkdir":
        monkeypatch.setattr(Path, "mkdir", peer_first(Path.mkdir, raises=True))
    else:
        monkeypatch.setattr(store, "atomic_open", peer_first(store.atomic_open, raises=False))
    zero.save_stage(2, 0, module, opt)
    assert removed and (folder / "stage-0.safetensors").exists()
    zero.leave({0})  # its own step unfinished: it can never be complete
    assert list(tmp_path.iterdir()) == []


def test_leaving_removes_only_what_can_never_be_complete(tmp_path):
    """Rank 0's part of step 2 is finished: while rank 1 runs it may still finish its own,
    so rank 0 stopping keeps it; once rank 1 has stopped too, it goes."""
    _save(tmp_path, 1, ranks=(0, 1))
    module, opt = _trained()
    zero, one = _ranks(tmp_path)
    zero.save_stage(2, 0, module, opt)
    zero.finish_rank(2, next_micro_batch=8)
    zero.leave({0})
    assert (step_dir(tmp_path, 2) / "rank-0.json").exists()
    one.save_stage(2, 1, module, opt)
    one.finish_rank(2, next_micro_batch=8)  # complete after all
    assert [s for s, _ in one.complete()] == [2, 1]
    zero.save_stage(3, 0, module, opt)
    zero.finish_rank(3, next_micro_batch=12)
    zero.leave({0, 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]


def test_ctrl_c_in_the_middle_of_a_save_leaves_the_checkpoints_before_and_nothing_else(
    tmp_path, monkeypatch
):
    """A rank stopped before its manifest of step 4 (Ctrl-C, mid-save): its part of step 4
    goes on its way out (it can never be complete), step 2 stays whole and resumes."""
    finish = Checkpoints.finish_rank

    def interrupted(self, step, *args, **kwargs):
        if step == 4:
            raise KeyboardInterrupt
        return finish(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpoints, "finish_rank", interrupted)
    argv = ["--steps", "4", "--save-every", "2"]
    with pytest.raises(SystemExit) as stopped:
        _run(argv, tmp_path)
    assert stopped.value.code == 130
    ck = tmp_path / "ckpt"
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002"]
    monkeypatch.setattr(Checkpoints, "finish_rank", finish)
    assert _run([*argv, "--resume"], tmp_path)["first_step"] == 2


def test_a_run_starting_removes_what_a_killed_rank_left_of_a_given_up_step(tmp_path):
    module, opt = _save(tmp_path, 1, ranks=(0, 1))
    zero, one = _ranks(tmp_path)
    zero.save_stage(2, 0, module, opt)
    zero.finish_rank(2, next_micro_batch=8)
    one.save_stage(2, 1, module, opt)
    one.finish_rank(2, next_micro_batch=8)
    (step_dir(tmp_path, 2) / ABANDONED).touch()  # rank 0 killed before it could leave
    resumed = Checkpoints(tmp_path, 0, 2, _identity())
    step, manifest = resumed.choose()
    assert step == 1  # all manifests there, yet given up: no checkpoint
    resumed.start(manifest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


def test_a_killed_save_leaves_a_temporary_that_is_removed(tmp_path):
    _save(tmp_path, 2, ranks=(0, 1))
    stale = step_dir(tmp_path, 2) / ".stage-0.safetensors.4242-0123abcd.tmp"
    stale.write_bytes(b"half a file")
    assert remove_temporaries(tmp_path) == [stale]
    assert not stale.exists() and (step_dir(tmp_path, 2) / "stage-0.safetensors").exists()


def _run(argv, tmp_path):
    return run(one_rank_plan(), STAGES, argv + ["--checkpoint-dir", str(tmp_path / "ckpt")])


def test_resume_after_a_damaged_checkpoint_equals_the_uninterrupted_run(tmp_path, capsys):
    # A constant rate: the run stopped at 6 of 6 steps then resumed for 8 is the 8-step run.
    base = ["--optimizer", "adamw", "--lr", "0.05", "--save-every", "2", "--decay", "constant"]
    whole = run(one_rank_plan(), STAGES, [*base, "--steps", "8", "--checkpoint-dir", str(tmp_path)])
    _run([*base, "--steps", "6"], tmp_path)  # stopped after step 6 ...
    manifest = json.loads((step_dir(tmp_path / "ckpt", 6) / "rank-0.json").read_text())
    assert manifest["next_micro_batch"] == 24 and manifest["run"]["plan"]
    (step_dir(tmp_path / "ckpt", 6) / "stage-2.safetensors").write_bytes(
        b"\0" * 100
    )  # ... and damaged
    stale = step_dir(tmp_path / "ckpt", 6) / ".stage-1.pt.999-0badf00d.tmp"  # a save killed
    stale.write_bytes(b"half")
    capsys.readouterr()
    resumed = _run([*base, "--steps", "8", "--resume"], tmp_path)
    err = capsys.readouterr().err
    assert "step-000006 is damaged (stage-2.safetensors" in err and "resuming from step 4" in err
    assert "learning-rate" not in err  # --steps 6 there and 8 here, but the rate is constant
    assert resumed["first_step"] == 4 and not stale.exists()
    assert resumed["losses"] == whole["losses"][4:]
    for name, value in checkpoint_params(tmp_path, 8, range(4)).items():
        assert torch.equal(value, checkpoint_params(tmp_path / "ckpt", 8, range(4))[name]), name
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["step-000004", "step-000006", "step-000008"]  # --keep-checkpoints 3


def test_resume_refuses_another_runs_checkpoint(tmp_path, capsys):
    _run(["--steps", "2", "--save-every", "2", "--schedule", "gpipe"], tmp_path)
    _run(["--steps", "4", "--save-every", "2", "--schedule", "gpipe", "--resume"], tmp_path)
    err = capsys.readouterr().err  # more --steps: allowed, but the decay changes, and it says so
    assert "had --steps 2, this one 4; the learning-rate schedule changes from step 2" in err
    with pytest.raises(SystemExit, match="saved by another run \\(schedule 'gpipe' there"):
        _run(["--steps", "4", "--save-every", "2", "--schedule", "1f1b", "--resume"], tmp_path)
    with pytest.raises(SystemExit, match="holds checkpoints of another run \\(seed 0 there, 3"):
        _run(["--steps", "4", "--save-every", "2", "--seed", "3"], tmp_path)


def test_a_folder_holds_one_runs_checkpoints(tmp_path):
    """A new run with the very same settings is another run too: refused, unless it replaces
    them; a step whose manifests name two runs (one rewrote it, cut short) is no checkpoint."""
    _save(tmp_path, 2, ranks=(0, 1))
    new = Checkpoints(tmp_path, 0, 2, _identity())
    with pytest.raises(PipelineConfigError) as refused:
        new.refuse_foreign()
    assert str(refused.value) == (
        f"{tmp_path} holds checkpoints of another run (1 saved, the newest of step 2); continue "
        "it with --resume, replace them with --overwrite-checkpoints, or choose another "
        "--checkpoint-dir"
    )
    first = [Checkpoints(tmp_path, r, 2, _identity()) for r in (0, 1)]
    for ckpt in first:  # resumed: the run keeps its id (here: none, an older ftpipe's)
        ckpt.start(ckpt.choose()[1], agree=lambda v: [v])
    assert first[0].run_id and first[0].run_id != first[1].run_id  # each made its own ...
    ids = [c.run_id for c in first]
    for ckpt in first:  # ... and every rank takes rank 0's
        ckpt.start(None, agree=lambda v: ids)
    _save_with(first, 4)
    manifests = dict(first[0].complete())[4]
    assert [m["run_id"] for m in manifests] == [ids[0], ids[0]]
    resumed = Checkpoints(tmp_path, 1, 2, _identity())
    resumed.start(resumed.choose()[1], agree=lambda v: [v])
    assert resumed.run_id == ids[0]
    other = [Checkpoints(tmp_path, r, 2, _identity()) for r in (0, 1)]
    for ckpt in other:
        ckpt.start(None, agree=lambda v: ["another"])
    _save_with(other[:1], 4)  # rank 0 of another run rewrote step 4, rank 1 not yet
    assert [step for step, _ in first[0].complete()] == [2]
    other[0].start(None, replace=True)  # --overwrite-checkpoints: rank 0 clears the folder
    assert list(tmp_path.iterdir()) == [tmp_path / ASIDE] and other[0].aside() == [2, 4]


def test_overwriting_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path):
    """--overwrite-checkpoints removed the old run's checkpoints at the start: a run that then
    stopped before saving (a rank failed at step 1) left the folder empty (the bad-input
    audit). Now they wait aside until its first checkpoint is complete on every rank."""
    _save(tmp_path, 2, ranks=(0, 1))
    _save(tmp_path, 4, ranks=(0, 1))
    old = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    dead = [Checkpoints(tmp_path, r, 2, _identity()) for r in (0, 1)]
    for ckpt in dead:
        ckpt.start(None, agree=lambda v: ["dead"], replace=True)
    _save_with(dead[:1], 1)  # rank 0 saved step 1, rank 1 failed before it: no checkpoint
    assert dead[0].aside() == [2, 4]
    # What the next run is told: nothing is lost, and where it is.
    again = Checkpoints(tmp_path, 0, 2, _identity())
    for look in (again.choose, again.refuse_foreign):
        with pytest.raises(PipelineConfigError) as told:
            look()
        assert str(told.value) == (
            f"{tmp_path / ASIDE} holds 2 checkpoints of another run, which an "
            "--overwrite-checkpoints run set aside and stopped before its first checkpoint; "
            f"move them back into {tmp_path} to resume them, replace them with "
            "--overwrite-checkpoints, or choose another --checkpoint-dir"
        )
    # Moved back, they resume as they were.
    for step in (2, 4):
        step_dir(tmp_path / ASIDE, step).rename(step_dir(tmp_path, step))
    shutil.rmtree(step_dir(tmp_path, 1))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == old
    assert Checkpoints(tmp_path, 1, 2, _identity()).choose()[0] == 4
    # Replaced again: the first replacing run's partial step goes at once, the old run's
    # checkpoints once the new run's step 1 is complete (rank 1's save completes it).
    for ckpt in dead:
        ckpt.start(None, agree=lambda v: ["dead"], replace=True)
    _save_with(dead[:1], 1)
    new = [Checkpoints(tmp_path, r, 2, _identity(), keep=0) for r in (0, 1)]
    for ckpt in new:
        ckpt.start(None, agree=lambda v: ["new"], replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ASIDE]
    _save_with(new[:1], 1)
    assert new[0].aside() == [2, 4]
    _save_with(new[1:], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


def _save_with(ckpts, step):
    module, opt = _trained()
    for ckpt in ckpts:
        ckpt.save_stage(step, ckpt.rank, module, opt)
        ckpt.finish_rank(step, next_micro_batch=4 * step)


def test_a_new_run_refuses_another_runs_folder_unless_told_to_replace_it(tmp_path, capsys):
    argv = ["--steps", "2", "--save-every", "2"]
    _run(argv, tmp_path)
    folder = tmp_path / "ckpt"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as refused:
        _run(argv, tmp_path)  # the same settings, no --resume: another run
    assert str(refused.value.code) == (
        f"ftpipe: {folder} holds checkpoints of another run (1 saved, the newest of step 2); "
        "continue it with --resume, replace them with --overwrite-checkpoints, or choose "
        "another --checkpoint-dir"
    )
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    first_id = json.loads((step_dir(folder, 2) / "rank-0.json").read_text())["run_id"]
    _run(["--steps", "4", "--save-every", "2", "--resume"], tmp_path)  # the same run goes on
    assert json.loads((step_dir(folder, 4) / "rank-0.json").read_text())["run_id"] == first_id
    _run(["--steps", "1", "--save-every", "1", "--overwrite-checkpoints"], tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]  # the old run is gone
    assert json.loads((step_dir(folder, 1) / "rank-0.json").read_text())["run_id"] != first_id
    with pytest.raises(SystemExit) as both:
        _run(["--steps", "2", "--resume", "--overwrite-checkpoints"], tmp_path)
    assert both.value.code == 2
    assert "--overwrite-checkpoints: not allowed with argument --resume" in capsys.readouterr().err


def test_the_plan_hash_ignores_where_the_optimizer_state_lives():
    """A plan read with the stage fields `offload` and `shard_optimizer` filled in (the typed
    reader's defaults) is the run it was without them: its checkpoints still resume."""
    from ftpipe_runtime.checkpoint.files import plan_hash

    bare = {"gpus": 2, "loss_stage": 1, "transfers": [], "params": [], "model": {"inputs": []},
            "stages": [{"id": 0, "gpu": 0}, {"id": 1, "gpu": 1}]}  # fmt: skip
    filled = {**bare, "stages": [
        {**s, "offload": {"optimizer": i == 1, "activations": False}, "shard_optimizer": False}
        for i, s in enumerate(bare["stages"])
    ]}  # fmt: skip
    assert plan_hash(filled) == plan_hash(bare)
    moved = {**bare, "stages": [{"id": 0, "gpu": 1}, {"id": 1, "gpu": 0}]}
    assert plan_hash(moved) != plan_hash(bare)
