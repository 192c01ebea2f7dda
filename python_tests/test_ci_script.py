"""CI runs what the README promises: its test command verbatim, then the tests that command leaves out, so that
no test is run by neither; benchmarks/time_quickstart.sh times the same command."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    commands = [line for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
                for line in block.splitlines() if "-m pytest" in line]
    assert len(commands) >= 1, "the README has no test command"
    return commands[0].strip()


def test_ci_runs_the_readme_test_command_verbatim_and_then_what_it_leaves_out():
    command = readme_test_command()
    ci = (ROOT / ".ci/run").read_text()
    assert command in [line.strip() for line in ci.splitlines()], f".ci/run lacks the README's test command: {command}"
    words = shlex.split(command.split(" && ")[-1])
    assert words[words.index("-m", 2) + 1] == "not slow", words  # after `-m pytest`, the marker expression
    assert re.search(r"pytest python_tests .*-m slow\b", ci), ".ci/run must run the tests marked slow"


def test_time_quickstart_times_the_readme_test_command():
    pytest_part = readme_test_command().split(" && ")[-1]
    assert pytest_part in (ROOT / "benchmarks/time_quickstart.sh").read_text()


def test_ci_installs_verl_as_the_docs_say_and_runs_the_verl_tests():
    ci, verl_part = (ROOT / ".ci/run").read_text(), (ROOT / ".ci/verl").read_text()
    assert re.search(r'^part "[^"]*verl[^"]*" bash \.ci/verl$', ci, flags=re.M), ".ci/run must run .ci/verl"
    docs = (ROOT / "docs/integrations.md").read_text()
    assert 'pip install --no-build-isolation -e ".[verl]"' in docs and '-e ".[verl]"' in verl_part
    for test in ("test_verl_rollout.py", "test_verl_integration.py", "test_verl_end_to_end.py", "test_verl_engine.py"):
        assert f"python_tests/{test}" in verl_part, f".ci/verl does not run {test}"
    assert (ROOT / f"python_tests/{'test_verl_end_to_end.py'}").is_file()
