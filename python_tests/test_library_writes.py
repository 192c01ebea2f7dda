"""Every write the library makes follows the trainer's rules (issue 32 items 6 and 11): never through a symbolic
link that leaves the directory written in, a full disk reported with the path and nothing replaced, and a run
directory's lock that is not a regular file refused by name."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from dllm_fast.files import atomic_directory, write_text_atomic
from dllm_fast.models import LLaDAConfig, LLaDAModel, checkpoint
from dllm_fast.train.metrics import plot_curves
from dllm_fast.train.run_dir import RunDirectory

HISTORY = [{"step": 1, "reward_mean": 0.5, "accuracy": 0.5}, {"step": 1, "eval_accuracy@24": 0.25}]
LINK_OUT = r"is a symbolic link to .*users_dir.*, outside the directory it is written in"


def tiny():
    torch.manual_seed(0)
    return LLaDAModel(LLaDAConfig.preset("tiny"))


def users_directory(tmp_path):
    """A directory of the user's, somewhere else, that a link in the output folder points to."""
    theirs = tmp_path / "elsewhere" / "users_dir"
    theirs.mkdir(parents=True)
    (theirs / "config.json").write_text('{"mine": true}')
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "model"
    link.symlink_to(theirs, target_is_directory=True)
    return link, theirs


def test_save_pretrained_never_replaces_a_directory_through_a_link_leaving_its_folder(tmp_path):
    link, theirs = users_directory(tmp_path)
    with pytest.raises(ValueError, match=LINK_OUT + r".* Write to the link's target itself"):
        tiny().save_pretrained(link)
    assert json.loads((theirs / "config.json").read_text()) == {"mine": True}
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["model"]  # no staging left behind


def test_a_link_within_the_folder_is_followed(tmp_path):
    (tmp_path / "v2").mkdir()
    (tmp_path / "latest").symlink_to("v2", target_is_directory=True)
    tiny().save_pretrained(tmp_path / "latest")
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "v2" / "model.safetensors").is_file()


def test_the_hf_adapters_save_follows_the_same_rule(tmp_path):
    from dllm_fast.models import HFDiffusionLM
    from test_hf_diffusion import TinyDreamConfig, TinyDreamModel

    link, theirs = users_directory(tmp_path)
    adapter = HFDiffusionLM(TinyDreamModel(TinyDreamConfig()))
    with pytest.raises(ValueError, match=LINK_OUT):
        adapter.save_pretrained(link)
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json"]
    assert json.loads((theirs / "config.json").read_text()) == {"mine": True}
    adapter.save_pretrained(tmp_path / "saved")  # a plain directory still works
    assert (tmp_path / "saved" / "config.json").is_file()


@pytest.mark.parametrize("write", ["text", "plot"])
def test_files_are_never_written_through_a_link_leaving_their_folder(tmp_path, write):
    theirs = tmp_path / "elsewhere" / "users_dir.txt"
    theirs.parent.mkdir()
    theirs.write_text("keep me")
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "file"
    link.symlink_to(theirs)
    with pytest.raises(ValueError, match=LINK_OUT):
        if write == "text":
            write_text_atomic(link, "replaced")
        else:
            plot_curves(HISTORY, link)
    assert theirs.read_text() == "keep me"


def test_the_curve_plot_is_written_whole(tmp_path):
    path = plot_curves(HISTORY, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["curves.png"]


# -- a full disk ------------------------------------------------------------------------------------------------

# What safetensors raises when the disk fills up (measured on a 64 KiB tmpfs).
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def test_a_full_disk_during_save_pretrained_names_the_path_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    model = tiny()
    model.save_pretrained(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}

    def full(*args, **kwargs):
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(OSError, match=r"cannot write .*ckpt: the disk is full .* Nothing was replaced") as error:
        model.save_pretrained(tmp_path / "ckpt")
    assert error.value.errno == 28
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (needs root and a kernel that lets this process mount; skipped elsewhere)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


@pytest.mark.parametrize("writer", ["save_pretrained", "torch.save"])
def test_a_really_full_disk_is_reported_as_such(small_disk, writer):
    target = small_disk / "ckpt"
    with pytest.raises(OSError, match=r"cannot write .*ckpt: the disk is full"):
        if writer == "save_pretrained":
            tiny().save_pretrained(target)
        else:  # the trainer's checkpoint: torch.save reports a full disk as "unexpected pos ..."
            with atomic_directory(target) as staging:
                torch.save({"weights": torch.zeros(2**16)}, staging / "optimizer.pt")
    assert list(small_disk.iterdir()) == []


# -- the run directory's lock -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "link_inside", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_refused_by_name(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".lock"
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "link_inside":
        (run / "my.lock").write_text("")
        lock.symlink_to("my.lock")
    else:
        lock.mkdir()
    with pytest.raises(OSError, match=r"the run directory's lock file .*run/\.lock is not a regular file; remove "
                                      r"it") as error:
        with RunDirectory(run).locked():
            pass
    assert error.value.errno == 22


def test_benchmark_results_are_written_under_the_same_rules(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import common

    theirs = tmp_path / "elsewhere" / "users_dir.json"
    theirs.parent.mkdir()
    theirs.write_text("keep me")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "smoke.json").symlink_to(theirs)
    with pytest.raises(ValueError, match=LINK_OUT):
        common.write_results("smoke", {}, [{"provider": "x"}], tmp_path / "out")
    assert theirs.read_text() == "keep me"
