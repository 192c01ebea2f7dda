"""The run directory against careless and hostile use (issue 17): no pickle on resume, one run per directory, no
write or delete through a link out of it, typed config files, resume continues the run that was started, lengths
within the model's positions, weights that follow the umask, and plain words for a full disk or an empty state."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from dllm_fast.train import TrainConfig, train
from dllm_fast.train import checkpoint as checkpoint_module
from dllm_fast.train.cli import config_from_arguments, new_parser, add_config_arguments, parse
from dllm_fast.train.run_dir import RunDirectory, RunDirectoryInUse

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = dict(steps=1, prompts_per_step=2, group_size=4, eval_every=10, checkpoint_every=1, eval_examples=4,
             progress=False, plot=False, threads=1, objective="vrpo_ol", objective_options={"n_t": 2})


def config(output_dir, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(output_dir), **overrides})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run directory with the checkpoint of a finished 1-step vrpo_ol run (not the default objective)."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    threads = torch.get_num_threads()
    train(config(output_dir))
    torch.set_num_threads(threads)
    return output_dir


@pytest.fixture
def run_dir(finished, tmp_path):
    """A copy of the finished run's directory to change."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy, symlinks=True)
    return copy


def cli_config(*arguments):
    parser = new_parser()
    add_config_arguments(parser)
    return config_from_arguments(parse(parser, list(arguments)))


# -- no pickle on resume ----------------------------------------------------------------------------------------

class Payload:
    """Runs code when unpickled: writes the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


@pytest.mark.slow
def test_a_crafted_state_is_refused_and_runs_nothing(run_dir, tmp_path):
    state_file = run_dir / "checkpoint" / "state.pt"
    state = torch.load(state_file, weights_only=True)
    marker = tmp_path / "marker"
    state["history"].append(Payload(marker))
    torch.save(state, state_file)
    with pytest.raises(ValueError, match="loading it could run code: refused"):
        train(config(run_dir, resume=True))
    assert not marker.exists()


@pytest.mark.slow
def test_an_empty_or_damaged_state_is_named(run_dir):
    state_file = run_dir / "checkpoint" / "state.pt"
    state_file.write_bytes(b"")
    with pytest.raises(ValueError, match=r"state.pt is empty"):
        train(config(run_dir, resume=True))
    state_file.write_bytes(b"not a zip archive")
    with pytest.raises(ValueError, match=r"state.pt is damaged and cannot be read"):
        train(config(run_dir, resume=True))


def altered_state(change):
    def alter(run_dir):
        state_file = run_dir / "checkpoint" / "state.pt"
        state = torch.load(state_file, weights_only=True)
        change(state)
        torch.save(state, state_file)
    return alter


def replaced(name, content=None):
    def replace(run_dir):
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        if content is not None:
            path.write_text(content) if isinstance(content, str) else path.mkdir()
    return replace


def _fast_first(cases, fast=4):
    """The first `fast` cases in the fast suite, the others marked slow (each case resumes a trained run)."""
    return [case if i < fast else pytest.param(*case, marks=pytest.mark.slow) for i, case in enumerate(cases)]


@pytest.mark.parametrize("alter, message", _fast_first([
    (altered_state(lambda s: s.pop("optimizer")), r"state.pt is damaged or was altered \(it lacks 'optimizer'\)"),
    (altered_state(lambda s: s.update(step="1")), r"state.pt is damaged .* \(its 'step' is of type str, not int\)"),
    (altered_state(lambda s: s.update(step=10**9)), r"state.pt is at step 1000000000, past the --steps 1 the run"),
    (altered_state(lambda s: s.update(data_position=7)), r"state.pt has taken 7 prompts in 1 steps of 2"),
    (altered_state(lambda s: s.update(streams=[])), r"it holds no random streams of each of its 1 ranks"),
    (altered_state(lambda s: s["streams"][0]["rng"].update(torch=torch.zeros(3, dtype=torch.uint8))),
     r"the checkpoint in .*checkpoint does not restore into this run \(RuntimeError: Expected a CPUGeneratorImpl"),
    (replaced("checkpoint/model"), r"checkpoint/model is missing: the checkpoint is incomplete"),
    (replaced("checkpoint/config.json", '{"objective": "bogus"}'),
     r"checkpoint/config.json, the configuration the checkpoint ran with, is not valid \(--objective 'bogus'"),
    (replaced("metrics.jsonl", True), r"metrics.jsonl is a directory, where the run keeps its metrics.jsonl file"),
]))
def test_a_damaged_or_altered_checkpoint_is_refused_and_left_as_it_was(run_dir, alter, message):
    alter(run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        train(config(run_dir, resume=True, steps=2))
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before


@pytest.mark.slow
def test_resuming_below_the_saved_step_is_refused(run_dir):
    state_file = run_dir / "checkpoint" / "state.pt"
    with pytest.raises(ValueError, match=r"--steps 1 is below the step 2 the checkpoint .* reached"):
        train(config(run_dir, resume=True, steps=2))  # now at step 2
        train(config(run_dir, resume=True, steps=1))
    assert torch.load(state_file, weights_only=True)["step"] == 2


def test_a_file_where_the_checkpoint_goes_is_refused_before_any_work(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_text("not a directory")
    with pytest.raises(ValueError, match=r"run/checkpoint is a file, where the run keeps its checkpoint directory"):
        train(config(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- one run per directory --------------------------------------------------------------------------------------

def test_a_second_trainer_on_a_run_directory_is_refused(tmp_path):
    with RunDirectory(tmp_path / "run").locked():
        with pytest.raises(RunDirectoryInUse, match=f"is in use by another training run \\(process {os.getpid()}"):
            train(config(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_lock_goes_with_the_process_that_held_it(tmp_path):
    """Released on a crash: a process killed while holding it leaves the directory free."""
    code = (f"import os, sys, time; from dllm_fast.train.run_dir import RunDirectory\n"
            f"with RunDirectory({str(tmp_path / 'run')!r}).locked():\n"
            f"    print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirectoryInUse, match=f"process {holder.pid}"):
        with RunDirectory(tmp_path / "run").locked():
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with RunDirectory(tmp_path / "run").locked():  # free again
        pass


# -- symbolic links out of the run directory --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["metrics.jsonl", "curves.png", "config.json"])
def test_a_file_linked_out_of_the_run_directory_is_never_written(tmp_path, name):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(outside)
    with pytest.raises(ValueError, match=f"run/{name} is a symbolic link to .*precious.txt, outside the run "
                                         "directory"):
        train(config(tmp_path / "run", plot=True))
    assert outside.read_text() == "keep me"


def test_overwrite_never_deletes_through_a_checkpoint_link(run_dir, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.move(run_dir / "checkpoint", outside)
    (run_dir / "checkpoint").symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(ValueError, match="run/checkpoint is a symbolic link to .*elsewhere, outside the run"):
        train(config(run_dir, overwrite=True))
    assert sorted(p.name for p in outside.iterdir()) == before


def test_a_link_inside_the_run_directory_is_followed(run_dir):
    shutil.move(run_dir / "checkpoint", run_dir / "checkpoint-1")
    (run_dir / "checkpoint").symlink_to("checkpoint-1", target_is_directory=True)
    assert train(config(run_dir, resume=True, steps=1)).steps == 1


# -- typed config files -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ('overwrite: "maybe"\n', r"run.yaml: overwrite = 'maybe' must be true or false"),
    ("lora: 2\n", r"run.yaml: lora = 2 must be true or false"),
    ("objective_options: [n_t, 4]\n", r"run.yaml: objective_options = \['n_t', 4\] must be a mapping"),
    ("lora_targets: {q_proj: 1}\n", r"run.yaml: lora_targets = \{'q_proj': 1\} must be a list of strings"),
    ("steps: 2.5\n", r"run.yaml: steps = 2.5 must be an integer"),
    ("steps: '2.5'\n", r"run.yaml: steps = '2.5' must be an integer"),
    ("steps: [1\n", r"config file .*run.yaml is not valid YAML"),
])
def test_config_file_values_are_typed_and_named_by_file_and_key(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises((TypeError, ValueError), match=message):
        TrainConfig.from_file(path)


def test_a_yaml_number_without_a_dot_is_a_number(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-4\nbf16: false\n")  # YAML 1.1 reads 1e-4 as a string
    config = TrainConfig.from_file(path)
    assert config.optim.lr == 1e-4 and config.model.bf16 is False


# -- resume continues the run that was started ------------------------------------------------------------------

def test_resume_takes_the_saved_configuration(run_dir):
    resumed = cli_config("--output-dir", str(run_dir), "--resume", "true", "--steps", "3", "--threads", "1")
    assert (resumed.objective.name, resumed.objective.options, resumed.run.steps) == ("vrpo_ol", {"n_t": 2}, 3)
    with pytest.raises(ValueError, match=r"these options differ from it: --seed 5 \(saved: 0\), --lr 0.001 "
                                         r"\(saved: 0.0001\)\. On resume only --steps"):
        cli_config("--output-dir", str(run_dir), "--resume", "true", "--lr", "1e-3", "--seed", "5")
    with pytest.raises(ValueError, match=r"--lora True \(saved: False\)"):
        cli_config("--output-dir", str(run_dir), "--resume", "true", "--lora", "true")
    with pytest.raises(ValueError, match=r"--objective 'espo' \(saved: 'vrpo_ol'\)"):  # the Python API too
        train(config(run_dir, resume=True, objective="espo", objective_options={}))
    result = train(resumed)
    assert result.steps == 3 and [row["step"] for row in result.history] == [0, 1, 2, 3]
    written = json.loads((run_dir / "config.json").read_text())
    assert written["objective"]["name"] == "vrpo_ol" and written["run"]["steps"] == 3  # what ran


def test_an_overwrite_run_killed_before_its_first_checkpoint_leaves_nothing_to_resume(run_dir, monkeypatch):
    from dllm_fast.train import loop

    def killed(run):
        raise KeyboardInterrupt  # the new run dies during its base evaluation

    monkeypatch.setattr(loop, "evaluate_lengths", killed)
    with pytest.raises(KeyboardInterrupt):
        train(config(run_dir, overwrite=True, objective="bgpo"))
    assert not (run_dir / "checkpoint").exists()
    assert json.loads((run_dir / "config.json").read_text())["objective"]["name"] == "bgpo"
    # --resume now finds no checkpoint: the old vrpo_ol run is not continued.
    assert cli_config("--output-dir", str(run_dir), "--resume", "true", "--objective", "bgpo").objective.name == "bgpo"


# -- lengths, permissions, a full disk --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sequence_longer_than_the_model_allows_is_refused_before_any_step(tmp_path):
    with pytest.raises(ValueError, match=r"longest training prompt .* with --gen-length 500 .* the model has 512"):
        train(config(tmp_path / "run", gen_length=500, block_length=500, diffusion_steps=500))
    with pytest.raises(ValueError, match=r"--gen-length 20000 leaves no room for a prompt: the model has 512"):
        train(config(tmp_path / "run", gen_length=20000, block_length=20000, diffusion_steps=12))
    with pytest.raises(ValueError, match=r"longest test prompt .* with --eval-gen-lengths 500 .* the model has 512"):
        train(config(tmp_path / "run", eval_gen_lengths=[24, 500]))


def test_saved_weights_follow_the_umask(finished):
    mask = os.umask(0)
    os.umask(mask)
    for file in (finished / "checkpoint").rglob("*"):
        if file.is_file():
            assert file.stat().st_mode & 0o777 == 0o666 & ~mask, file


@pytest.mark.slow
def test_a_full_disk_is_said_plainly_and_keeps_the_last_checkpoint(run_dir, monkeypatch):
    before = (run_dir / "checkpoint" / "state.pt").read_bytes()

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 1152 vs 1046")

    monkeypatch.setattr(checkpoint_module.torch, "save", full)
    with pytest.raises(OSError, match=r"could not write the checkpoint .*: the disk is full .* The previous "
                                      "checkpoint is intact"):
        train(config(run_dir, resume=True, steps=2))
    assert (run_dir / "checkpoint" / "state.pt").read_bytes() == before


# -- issue 40: every check of a setting before anything is written to the run folder ---------------------------

SDAR = dict(model="sdar-tiny", task_options={"prompt_style": "grid"}, block_length=4, gen_length=8,
            diffusion_steps=8, eval_gen_lengths=[8], cache="block")


@pytest.mark.parametrize("settings, message", [
    (dict(SDAR, cache="dual"), r"--cache dual is Fast-dLLM's approximate cache .* pass --cache block"),
    (dict(SDAR, cache="prefix"), r"--cache prefix is Fast-dLLM's approximate cache"),
    (dict(cache="block"), r"--cache block keeps the exact keys .* pass --cache prefix or dual .* or none"),
    (dict(model="dream-tiny", cache="dual"), r"--cache dual needs a model that predicts each position from itself"),
    (dict(SDAR, eval_gen_lengths=[6]), r"--eval-gen-lengths 6 is not a multiple of --block-length 4.*"
                                       r"pass --eval-gen-lengths 4 or --eval-gen-lengths 8"),
    (dict(SDAR, eval_gen_lengths=[8, 10]), r"--eval-gen-lengths 10 is not a multiple of --block-length 4.*"
                                           r"pass --eval-gen-lengths 8 or --eval-gen-lengths 12"),
    (dict(lora=True, lora_rank=1000), r"--lora-rank 1000 exceeds the model's width 64"),
    (dict(SDAR, lora=True, lora_rank=65), r"--lora-rank 65 exceeds the model's width 64"),
    (dict(threads=1000), r"--threads 1000 is more than this machine's \d+ CPUs"),
])
def test_a_setting_that_cannot_work_is_refused_before_the_run_folder_is_written(tmp_path, settings, message):
    """Issue 40 item 6: these were refused only once the run folder held .lock, config.json and metrics.jsonl."""
    run = tmp_path / "run"
    with pytest.raises((ValueError, TypeError), match=message):
        train(config(run, **settings))
    assert not run.exists()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises((ValueError, TypeError), match=message):
        train(config(run, **settings))
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_a_checkpoint_whose_block_length_differs_is_refused_before_the_run_folder_is_written(tmp_path):
    from dllm_fast.assets import SUDOKU4_DIR
    from dllm_fast.models import SDARModel
    from dllm_fast.models.loading import load_tokenizer, preset_config

    checkpoint = tmp_path / "sdar"
    tokenizer = load_tokenizer(SUDOKU4_DIR)
    SDARModel.with_random_weights(preset_config("sdar-tiny", tokenizer)).save_pretrained(checkpoint)  # blocks of 4
    run = tmp_path / "run"
    settings = dict(SDAR, model=str(checkpoint), tokenizer=str(SUDOKU4_DIR), block_length=8, eval_gen_lengths=[8])
    with pytest.raises(ValueError, match=r"--block-length 8, but --model .* trained with blocks of 4 .* pass "
                                         r"--block-length 4"):
        train(config(run, **settings))
    assert not run.exists()


def test_the_command_line_writes_nothing_for_a_setting_that_cannot_work(tmp_path, capsys):
    from dllm_fast.train.cli import main

    run = tmp_path / "run"
    for arguments in (["--model", "sdar-tiny", "--gen-length", "8", "--block-length", "4", "--diffusion-steps", "8",
                       "--cache", "dual"],
                      ["--model", "sdar-tiny", "--gen-length", "8", "--block-length", "4", "--diffusion-steps", "8",
                       "--eval-gen-lengths", "6", "--cache", "block"],
                      ["--threads", "1000"], ["--lora", "true", "--lora-rank", "1000"]):
        with pytest.raises(SystemExit) as exit:
            main(["--output-dir", str(run), "--steps", "1", "--progress", "false", *arguments])
        assert exit.value.code == 2  # a bad option, found before anything is written
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and arguments[-1] in error, error
        assert not run.exists()


@pytest.mark.slow  # three training runs, about 10 s on 2 cores
def test_a_run_started_with_overwrite_resumes(run_dir):
    """Its config.json says overwrite: true; the resumed run is this call's --resume, not the saved --overwrite."""
    for path in (run_dir / "config.json", run_dir / "checkpoint" / "config.json"):
        saved = json.loads(path.read_text())
        saved["run"]["overwrite"] = True  # as `train --overwrite true` writes it
        path.write_text(json.dumps(saved))
    resumed = cli_config("--output-dir", str(run_dir), "--resume", "true", "--steps", "2")
    assert resumed.run.resume and not resumed.run.overwrite
    assert train(resumed).steps == 2


def test_a_full_disk_at_the_first_checkpoint_does_not_claim_a_previous_one(tmp_path, monkeypatch):
    """Issue 40 item 10: it said "The previous checkpoint is intact" when there was none."""
    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 1152 vs 1046")

    monkeypatch.setattr(checkpoint_module.torch, "save", full)
    run = tmp_path / "run"
    with pytest.raises(OSError, match=r"could not write the checkpoint .*: the disk is full .* This was the run's "
                                      r"first checkpoint: there is none to resume from") as error:
        train(config(run))
    assert "previous checkpoint is intact" not in str(error.value)
    assert not (run / "checkpoint").exists()


def test_the_library_says_whether_a_previous_file_or_folder_was_there(tmp_path):
    import errno

    from dllm_fast.files import atomic_directory, atomic_path

    def fill(error):
        raise OSError(errno.ENOSPC, "No space left on device")

    for existed in (False, True):
        target = tmp_path / f"dir{existed}"
        if existed:
            target.mkdir()
        with pytest.raises(OSError, match="Nothing was replaced: the previous dir" if existed else
                           r"Nothing was written: there was no dir\w+ before"):
            with atomic_directory(target):
                fill(None)
        path = tmp_path / f"file{existed}"
        if existed:
            path.write_text("old")
        with pytest.raises(OSError, match="the previous file" if existed else r"there was no file\w+ before"):
            with atomic_path(path):
                fill(None)
