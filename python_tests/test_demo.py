"""`python -m dllm_fast demo` says what it is doing as it goes (issue 32 item 13): it printed nothing for minutes
after "rollouts: ..." on a loaded machine, while the reference sampler ran."""

import re

import pytest

from dllm_fast import demo

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_demo_counts_each_samplers_forwards_before_its_result(capsys):
    demo.main(["--preset", "tiny", "--batch", "2", "--prompt-length", "8", "--gen-length", "16",
               "--rollout-length", "32", "--n-t", "2"])
    out = capsys.readouterr().out
    for label in ("reference cache=none", "dllm_fast cache=none", "dllm_fast cache=prefix", "dllm_fast cache=dual"):
        started, first, result = (re.search(rf"{label} *: {what}", out).start()
                                  for what in ("starting", "forward 1/16", r" *[\d.]+ tokens/s"))
        assert started < first < result, label
    assert re.search(r"streaming: forward 4/4\r +streaming: value", out)
    assert out.rstrip().endswith("checkpoint round trip in the official layout: identical hidden states")
