"""Shared benchmark plumbing: providers, sweeps, timing, memory, ratios, JSON and table output.

Every benchmark in this folder has the same shape (after Liger-Kernel's benchmark scripts):

    PROVIDERS = {p.name: p for p in [Provider("naive", setup, run_naive), Provider("dllm_fast", setup, run_fused)]}

    def measure(provider, point) -> dict:            # the metrics of one provider at one point of the sweep
        state = provider.prepare(point)              # setup (untimed) + warm-up
        timing = time_call(lambda: provider.run(state), point["device"], repeats=...)
        return dict(ms=timing.median_s * 1e3, min_ms=timing.min_s * 1e3,
                    saved_mib=saved_bytes(lambda: provider.run(state)) / 2**20,
                    peak_mib=peak_extra_bytes(provider, point, state) / 2**20)

    points = [dict(device="cpu", M=M, d=512) for M in args.m]   # the sweep: one dict of plain values per point
    rows = run_sweep(points, [PROVIDERS[n] for n in args.providers], measure, row_keys=("M", "d"))
    add_ratio(rows, "speedup", "ms", baseline={"provider": "naive"}, match=("M",), invert=True)
    print_table(rows, [...]); write_results("name_cpu", config, rows, args.results_dir)

- A **point** is a dict of JSON-able values (sizes, dtype names, the device as a string under "device"): it
  fully describes the inputs, so a fresh process can rebuild them.
- A **Provider** is a name plus `setup(point) -> state` (builds the inputs or the model; untimed), `run(state)`
  (the measured operation) and optionally `warm_up(state)` (default: one run) and `modes`, named
  sub-operations that are timed separately (Liger's operation modes, e.g. {"fwd": forward only}). setup, run,
  warm_up and modes must be module-level functions (or functools.partial of them) so that they pickle into the
  fresh processes that measure CPU memory.
- **Measurements** shared by all benchmarks: `time_call` (min and median wall-clock over repeats, CUDA
  synchronised), `saved_bytes` (what autograd saves for backward: every saved storage, or the peak alive at
  once), `peak_extra_bytes` (peak above the post-warm-up baseline: torch.cuda.max_memory_allocated on CUDA, the
  resident peak of a fresh process on CPU), `training_memory` (both, for a gradient step), and
  `measure_in_fresh_process` (setup, warm-up, timed runs and the
  peak all in one fresh process, for providers that must not share a process), `measure_in_tree` (the same with
  dllm_fast imported from another checkout, e.g. the commit before a change, built in place: before and after
  in one run), and `time_interleaved` (several providers' runs alternated, so that a shared machine's load
  drifts over all of them alike).
- `run_sweep` loops points x providers, catches CUDA out-of-memory errors (that provider is then skipped for
  the rest of the sweep), prints progress and returns one row per (point, provider) with a "status".
  `add_ratio` compares each row with a baseline row (another provider at the same point, or the same provider
  at another point). `write_results` writes rows, config, machine, commit and command as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


# ---------------------------------------------------------------------------------------------------------
# providers and sweeps


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation compared at every point of a sweep (see the module docstring)."""

    name: str
    setup: Callable[[dict], Any]
    run: Callable[[Any], Any]
    warm_up: Callable[[Any], Any] | None = None
    modes: Mapping[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)

    def prepare(self, point: dict) -> Any:
        """setup(point), then the warm-up (one run unless warm_up is given); returns the state."""
        state = self.setup(point)
        (self.warm_up or self.run)(state)
        return state


def run_sweep(points: Iterable[dict], providers: Sequence[Provider], measure: Callable[[Provider, dict], dict],
              *, row_keys: Sequence[str], skip: Callable[[Provider, dict], str | None] | None = None) -> list[dict]:
    """Rows of {row_keys of the point, provider, status, **measure(provider, point)} for every point x provider.

    `skip(provider, point)` may return a reason not to run (recorded as the status). A CUDA out-of-memory error
    records status "oom" and skips that provider at the later points."""
    rows, failed = [], {}
    for point in points:
        for provider in providers:
            row = {key: point[key] for key in row_keys} | {"provider": provider.name}
            reason = failed.get(provider.name) or (skip(provider, point) if skip else None)
            if reason:
                rows.append(row | {"status": reason})
                continue
            try:
                row.update(measure(provider, point))
                row["status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                where = ", ".join(f"{key}={point[key]}" for key in row_keys)
                failed[provider.name] = f"skipped: oom at {where}"
                row["status"] = "oom"
            free_memory(point)
            rows.append(row)
            print(progress(row), flush=True)
    return rows


def add_ratio(rows: list[dict], name: str, metric: str, *, baseline: Mapping[str, Any], match: Sequence[str],
              invert: bool = False) -> None:
    """row[name] = row[metric] / base[metric] (base / row with invert=True, for speed-ups), where base is the row
    whose keys equal `baseline` and whose `match` keys equal the row's. Only rows with status "ok" take part."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get(metric) is not None]
    for row in ok:
        base = next((b for b in ok if all(b.get(k) == v for k, v in baseline.items())
                     and all(b.get(k) == row.get(k) for k in match)), None)
        if base is None or not base[metric] or not row[metric]:  # no baseline, or a zero that has no ratio
            continue
        row[name] = base[metric] / row[metric] if invert else row[metric] / base[metric]


def progress(row: dict) -> str:
    """One line of a row's scalar values (lists such as generated tokens are left out)."""
    scalars = {k: v for k, v in row.items() if isinstance(v, (int, float, str, bool)) or v is None}
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in scalars.items())


def free_memory(point: dict) -> None:
    gc.collect()
    if torch.device(point["device"]).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# timing and memory


def synchronize(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float


def time_call(fn: Callable[[], Any], device, *, warmup: int = 1, repeats: int = 3) -> Timing:
    """Median and minimum wall-clock seconds of fn() over `repeats` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return Timing(median_s=statistics.median(samples), min_s=min(samples))


def saved_bytes(fn: Callable[[], Any], *, live: bool = False, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd saves for backward during fn(): every distinct storage saved, or with live=True the most
    that were alive at once (for code that runs several backward passes). `exclude`: tensors not to count,
    typically the parameters."""
    from dllm_fast.memory import count_saved_tensors, track_live_saved_tensors

    exclude = list(exclude)
    if live:
        with track_live_saved_tensors(exclude=exclude) as tracker:
            fn()
        return tracker.peak
    with count_saved_tensors(exclude=exclude) as counter:
        fn()
    return counter.bytes


def cuda_peak_extra_bytes(fn: Callable[[], Any], device) -> int:
    """Peak bytes allocated by fn() on the GPU above what was allocated before it."""
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def peak_extra_bytes(provider: Provider, point: dict, state: Any = None, *,
                     env: Mapping[str, str] | None = None) -> int:
    """Peak memory of one provider.run above the baseline after setup and warm-up. On CUDA: max_memory_allocated
    in this process, on `state` (prepared here when None). On CPU: the resident peak of a fresh process, so that
    nothing this process holds counts; `env` adds environment variables to that process."""
    if torch.device(point["device"]).type == "cuda":
        state = provider.prepare(point) if state is None else state
        return cuda_peak_extra_bytes(lambda: provider.run(state), point["device"])
    return measure_in_fresh_process(provider, point, repeats=1, env=env)["peak_bytes"]


def training_memory(provider: Provider, point: dict, state: Any, *, exclude: Iterable[torch.Tensor],
                    resident_peak: bool = True, default_malloc: bool = False) -> dict:
    """saved_mib (the most saved-for-backward bytes alive at once, `exclude` not counted) and, unless
    resident_peak is False on CPU, peak_mib (peak_extra_bytes). On CPU the fresh process runs with
    MALLOC_MMAP_THRESHOLD_=64 KiB so that freed activations leave the heap, unless default_malloc."""
    row = {"saved_mib": saved_bytes(lambda: provider.run(state), live=True, exclude=exclude) / 2**20}
    if resident_peak or torch.device(point["device"]).type == "cuda":
        env = {} if default_malloc else {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
        row["peak_mib"] = peak_extra_bytes(provider, point, state, env=env) / 2**20
    return row


def measure_in_fresh_process(provider: Provider, point: dict, *, repeats: int = 1,
                             summarize: Callable[[Any], Any] | None = None,
                             env: Mapping[str, str] | None = None) -> dict:
    """In a fresh (spawned) process with this process's thread count: provider.prepare(point), then `repeats`
    timed runs. Returns {"timing": Timing, "peak_bytes": peak above the post-warm-up baseline over the timed runs
    (resident memory on CPU, max_memory_allocated on CUDA), "summary": summarize(last result) or None}.
    `summarize` must be a module-level function and return plain (picklable, CPU) values."""
    with _environment(env or {}):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_fresh_process_worker, (provider, point, repeats, summarize, torch.get_num_threads()))


def _fresh_process_worker(provider, point, repeats, summarize, threads) -> dict:
    from dllm_fast.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(threads)
    device = torch.device(point["device"])
    state = provider.prepare(point)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        gc.collect()
        reset_peak_rss()
        baseline = current_rss_bytes()
    samples, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = provider.run(state)
        synchronize(device)
        samples.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    return dict(timing=Timing(median_s=statistics.median(samples), min_s=min(samples)), peak_bytes=peak - baseline,
                summary=summarize(result) if summarize else None)


_TREE_DRIVER = """
import json, sys
module, name, point, repeats, threads, tree, bench_dir = sys.argv[1:]
sys.path[:0] = [tree, bench_dir]
import importlib
import common
provider = importlib.import_module(module).PROVIDERS[name]
out = common._fresh_process_worker(provider, json.loads(point), int(repeats), None, int(threads))
timing = out["timing"]
import dllm_fast
print("DLLM_FAST_TREE " + json.dumps(dict(median_s=timing.median_s, min_s=timing.min_s, peak_bytes=out["peak_bytes"],
                                          package=dllm_fast.__file__)))
"""


def measure_in_tree(module: str, provider: str, point: dict, tree: str | os.PathLike, *, repeats: int = 1,
                    env: Mapping[str, str] | None = None, timeout: float = 3600) -> dict:
    """`measure_in_fresh_process` of `module.PROVIDERS[provider]` (a benchmark in this folder, by name) with
    dllm_fast imported from another checkout `tree` (built in place), e.g. `git archive <commit> | tar -x -C
    /tmp/before` and `python setup.py build_ext --inplace` there: the same benchmark code drives both trees, so
    a change's before and after are measured side by side in one run. Returns {"timing", "peak_bytes",
    "package"} (the dllm_fast/__init__.py that was imported)."""
    tree = str(Path(tree).resolve())
    if not (Path(tree) / "dllm_fast").is_dir():
        raise ValueError(f"{tree} holds no dllm_fast package; give the root of a checkout built in place.")
    arguments = [module, provider, json.dumps(point), str(repeats), str(torch.get_num_threads()), tree,
                 str(BENCH_DIR)]
    environment = dict(os.environ) | dict(env or {}) | {"PYTHONPATH": tree}
    result = subprocess.run([sys.executable, "-c", _TREE_DRIVER, *arguments], capture_output=True, text=True,
                            env=environment, timeout=timeout)
    line = next((l for l in result.stdout.splitlines() if l.startswith("DLLM_FAST_TREE ")), None)
    if result.returncode != 0 or line is None:
        raise RuntimeError(f"{provider} in {tree} failed:\n{result.stderr[-4000:]}")
    values = json.loads(line.split(" ", 1)[1])
    return dict(timing=Timing(median_s=values["median_s"], min_s=values["min_s"]), peak_bytes=values["peak_bytes"],
                package=values["package"])


def time_interleaved(runs: Mapping[str, Callable[[], Any]], device, *, repeats: int = 3) -> dict[str, Timing]:
    """Median and minimum seconds of each run, timed in turns (a, b, a, b, ...) after no warm-up: on a machine
    shared with other work, a load that comes and goes then weighs on every run alike."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    return {name: Timing(median_s=statistics.median(values), min_s=min(values)) for name, values in samples.items()}


@contextlib.contextmanager
def _environment(extra: Mapping[str, str]):
    """os.environ plus `extra` while active (a spawned process copies it when it starts)."""
    saved = os.environ.copy()
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ---------------------------------------------------------------------------------------------------------
# output


def add_results_dir_argument(parser) -> None:
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help=f"where the JSON results go (default: {RESULTS_DIR.relative_to(BENCH_DIR.parent)})")


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_results(name: str, config: dict, rows: list[dict], results_dir: Path = RESULTS_DIR) -> Path:
    from dllm_fast.files import write_text_atomic

    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    payload = {"benchmark": name, "commit": git_commit(), "machine": machine(), "config": config, "rows": rows,
               "command": " ".join([Path(sys.executable).name] + sys.argv)}
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")  # the library's rules: atomic, no link out
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
