"""benchmarks/common.py's provider structure, which every benchmark shares: sweeps, ratios, timing, memory."""

import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
from common import Provider  # noqa: E402

MIB = 2**20


# Module-level so that they pickle into the fresh process of measure_in_fresh_process.
def hold_32_mib(point):
    return torch.ones(32 * MIB // 4)  # setup memory: allocated before the baseline, so never counted


def allocate_64_mib(held):
    return float(torch.ones(64 * MIB // 4).sum()) + float(held[0])  # touched pages: resident


def row_count(result):
    return {"value": result}


@pytest.mark.slow  # a fresh python process that imports torch
def test_fresh_process_counts_the_run_not_the_setup(one_thread):
    provider = Provider("alloc", setup=hold_32_mib, run=allocate_64_mib)
    out = common.measure_in_fresh_process(provider, {"device": "cpu"}, repeats=2, summarize=row_count)
    assert 60 * MIB <= out["peak_bytes"] <= 90 * MIB
    assert out["summary"] == {"value": 64 * MIB // 4 + 1.0}
    assert 0 < out["timing"].min_s <= out["timing"].median_s


def test_time_call_reports_min_and_median():
    calls = []
    timing = common.time_call(lambda: calls.append(1), "cpu", warmup=2, repeats=5)
    assert len(calls) == 7 and 0 <= timing.min_s <= timing.median_s


def test_saved_bytes_counts_all_or_the_live_peak():
    x = torch.ones(1000, requires_grad=True)

    def two_graphs():
        for _ in range(2):  # each graph saves x (4000 bytes) and a fresh y (4000 bytes), then frees y's
            y = torch.ones(1000).requires_grad_()
            (x * y).sum().backward()

    assert common.saved_bytes(two_graphs, exclude=[x]) == 8000
    assert common.saved_bytes(two_graphs, live=True, exclude=[x]) == 4000


def test_sweep_records_status_skips_and_out_of_memory(capsys):
    def measure(provider, point):
        if provider.name == "big" and point["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"ms": point["n"] * (1.0 if provider.name == "base" else 0.5)}

    providers = [Provider(name, setup=dict, run=print) for name in ("base", "fast", "big")]
    points = [{"device": "cpu", "n": n, "unused": "x"} for n in (1, 2, 3)]
    skip = lambda provider, point: "skipped: too slow" if provider.name == "fast" and point["n"] == 3 else None
    rows = common.run_sweep(points, providers, measure, row_keys=("n",), skip=skip)
    status = {(r["n"], r["provider"]): r["status"] for r in rows}
    assert status == {(1, "base"): "ok", (1, "fast"): "ok", (1, "big"): "ok",
                      (2, "base"): "ok", (2, "fast"): "ok", (2, "big"): "oom",
                      (3, "base"): "ok", (3, "fast"): "skipped: too slow", (3, "big"): "skipped: oom at n=2"}
    assert all("unused" not in r for r in rows)
    assert "provider=fast" in capsys.readouterr().out

    common.add_ratio(rows, "speedup", "ms", baseline={"provider": "base"}, match=("n",), invert=True)
    common.add_ratio(rows, "ms_vs_n1", "ms", baseline={"n": 1}, match=("provider",))
    by_key = {(r["n"], r["provider"]): r for r in rows}
    assert by_key[(2, "fast")]["speedup"] == 2.0 and by_key[(2, "base")]["speedup"] == 1.0
    assert by_key[(3, "base")]["ms_vs_n1"] == 3.0
    assert "speedup" not in by_key[(2, "big")] and "speedup" not in by_key[(3, "fast")]


def test_write_results_goes_where_asked(tmp_path):
    path = common.write_results("smoke", {"a": 1}, [{"provider": "x", "ms": 1.5}], tmp_path / "out")
    assert path == tmp_path / "out" / "smoke.json" and '"ms": 1.5' in path.read_text()


@pytest.mark.parametrize("module", ["bench_logprob", "bench_rollout", "bench_elbo"])
def test_every_benchmark_uses_the_shared_provider_structure(module):
    """Providers pickle (fresh-process memory needs it) and are common.Provider instances keyed by name."""
    bench = __import__(module)
    assert bench.PROVIDERS and all(isinstance(p, Provider) and p.name == name for name, p in bench.PROVIDERS.items())
    for provider in bench.PROVIDERS.values():
        assert pickle.loads(pickle.dumps(provider)).name == provider.name


def test_logprob_providers_agree_on_a_small_point(one_thread):
    import bench_logprob

    point = dict(device="cpu", M=5, d=8, V=50, dtype="float32")
    inputs = bench_logprob.make_inputs(point)
    naive, fused = (bench_logprob.PROVIDERS[name].modes["fwd"](inputs) for name in ("naive", "dllm_fast"))
    torch.testing.assert_close(naive, fused)


def test_bench_logprob_writes_beside_the_recorded_results_unless_asked(monkeypatch, tmp_path):
    """Issue 32 item 14: an exploratory run writes logprob_cpu.new.json, which git ignores, beside the tracked
    logprob_cpu.json; --record (or --name) writes the named file."""
    import subprocess

    import bench_logprob

    written = []
    monkeypatch.setattr(bench_logprob, "run_sweep", lambda *args, **kwargs: [])
    monkeypatch.setattr(bench_logprob, "add_ratio", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench_logprob, "print_table", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench_logprob, "write_results", lambda name, *args: written.append(name) or name)
    for argv in ([], ["--record"], ["--name", "mine"], ["--name", "mine", "--record"]):
        bench_logprob.main(["--m", "4", "--repeats", "1", "--results-dir", str(tmp_path), *argv])
    assert written == ["logprob_cpu.new", "logprob_cpu", "mine.new", "mine"]
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked")
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/logprob_cpu.new.json"], cwd=root)
    tracked = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/logprob_cpu.json"], cwd=root)
    assert ignored.returncode == 0 and tracked.returncode == 1


def test_rollout_roofline_follows_the_cache_policy_plan():
    """The roofline counts the tokens each cache policy feeds (the fed span of every step), so a bandwidth-free,
    compute-bound roofline orders the modes none > prefix > dual, and the FLOPs match the fed spans."""
    import bench_rollout
    from dllm_fast.rollout import CACHE_POLICIES
    from dllm_fast.models import LLaDAConfig

    config = LLaDAConfig.preset("tiny")
    point = dict(batch=2, prompt=10, gen=16, block=8, steps=8)
    compute_bound = (1.0, float("inf"))  # 1 FLOP/s: seconds are FLOPs
    seconds = {mode: bench_rollout.roofline_seconds(config, point, mode, compute_bound) for mode in CACHE_POLICIES}
    assert seconds["none"] > seconds["prefix"] > seconds["dual"] > 0
    d, layers, total = config.d_model, config.n_layers, 26
    body = 2 * layers * (4 * d * d + 3 * d * config.mlp_hidden_size) + 4 * layers * total * d
    head = 2 * config.vocab_size * d
    steps = list(bench_rollout.planned_steps(CACHE_POLICIES["dual"], 10, 16, 8, 4))
    # dual: each block's first step feeds all 26 positions, its other steps the block's 8
    assert [fed for fed, _ in steps] == [26, 8, 8, 8, 26, 8, 8, 8]
    assert seconds["dual"] == sum(2 * (fed * body + masked * head) for fed, masked in steps)


def test_time_interleaved_alternates_the_runs():
    order = []
    timings = common.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, "cpu",
                                      repeats=3)
    assert order == ["a", "b"] * 3
    assert set(timings) == {"a", "b"} and all(0 <= t.min_s <= t.median_s for t in timings.values())


@pytest.mark.slow
def test_measure_in_tree_imports_dllm_fast_from_that_checkout(tmp_path, one_thread):
    """The same benchmark code driven with another checkout's package (here a copy of this one)."""
    import shutil

    import dllm_fast

    tree = tmp_path / "before"
    shutil.copytree(Path(dllm_fast.__file__).parent, tree / "dllm_fast",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    point = dict(device="cpu", M=8, d=16, V=256, dtype="float32")
    out = common.measure_in_tree("bench_logprob", "dllm_fast", point, tree, repeats=2)
    assert Path(out["package"]) == tree / "dllm_fast" / "__init__.py"
    assert 0 < out["timing"].min_s <= out["timing"].median_s and out["peak_bytes"] >= 0
    with pytest.raises(ValueError, match="holds no dllm_fast package"):
        common.measure_in_tree("bench_logprob", "dllm_fast", point, tmp_path / "nothing")


def test_split_key_flash_attention_equals_attention():
    """bench_attention's split-KV form (key halves folded into the batch, merged by their logsumexp) is attention."""
    import bench_attention

    q, k, v, cache = bench_attention.inputs(2, 4, 8, 64, 32, torch.float64, torch.device("cpu"))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(bench_attention.split_flash(q.float(), cache.float(), 4), want.float(), atol=1e-5,
                               rtol=1e-5)
