"""The summary of a resumed run counts this process's steps (issue 32 item 15): after resuming at step 50 with
--steps 51 it said "51 steps in 63 s" for a process that ran one step."""

import pytest

from dllm_fast.train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = ["--prompts-per-step", "2", "--group-size", "2", "--eval-every", "10", "--checkpoint-every", "1",
         "--eval-examples", "2", "--eval-batch-size", "2", "--progress", "false", "--plot", "false", "--threads", "1",
         "--objective", "vrpo_ol", "--objective-options", '{"n_t": 1}']


def summary(capsys, *argv):
    main([*QUICK, *argv])
    return capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_resumed_run_reports_the_steps_this_process_ran(tmp_path, capsys):
    run = ["--output-dir", str(tmp_path / "run")]
    assert summary(capsys, *run, "--steps", "2").startswith("2 steps in ")
    line = summary(capsys, *run, "--steps", "3", "--resume", "true")
    assert line.startswith("1 step (resumed at step 2; the run is at step 3) in "), line
