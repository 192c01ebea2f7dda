"""The suite fails on a warning raised from dllm_fast's own code (pyproject's filterwarnings), and only there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_warning_from_dllm_fast_fails_the_suite(tmp_path):
    (tmp_path / "test_warns.py").write_text(
        "import warnings\n\n"
        "def test_from_the_package():\n"
        "    exec(\"import warnings; warnings.warn('new warning')\", {'__name__': 'dllm_fast.some_module'})\n\n"
        "def test_from_elsewhere():\n"
        "    warnings.warn('a third-party warning')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_warns.py")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert "FAILED test_warns.py::test_from_the_package - UserWarning: new warning" in run.stdout, run.stdout
    assert "1 failed, 1 passed" in run.stdout, run.stdout
