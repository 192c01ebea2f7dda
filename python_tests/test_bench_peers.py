"""benchmarks/bench_peers.py: dllm_fast beside the official peers. Without checkouts (CI): its arguments, its
rows, the messages naming a missing peer, how the peers' code is loaded. With the checkouts (the folder in
$DLLM_FAST_PEERS, else .gpu/peers/; benchmarks/pack_peers.sh makes it): the small preset end to end, every peer
agreeing with dllm_fast (tokens at T = 0, loss values to 1e-6, gradients)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_peers  # noqa: E402
import peer_code  # noqa: E402

PEERS = Path(os.environ.get(bench_peers.ENV_PEERS) or peer_code.default_peers_dir())
ROW_KEYS = {"kind", "setting", "provider", "status"}


def missing_peers() -> list[str]:
    return [reason for name in peer_code.PEERS if (reason := peer_code.missing(PEERS, name))]


# -- without checkouts -------------------------------------------------------------------------------------------

def test_arguments_are_checked_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_peers.parse_arguments(["--peers", str(tmp_path / "absent")])
    assert "absent: no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_peers.parse_arguments(["--peers", str(tmp_path), "--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_peers.parse_arguments(["--peers", str(tmp_path), "--preset", "70b"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench_peers.parse_arguments(["--peers", str(tmp_path), "--device", "cuda"])
        assert "no usable CUDA device" in capsys.readouterr().err
    args = bench_peers.parse_arguments(["--peers", str(tmp_path)])
    assert (args.preset, args.device, args.dtype, args.threads) == ("small", "cpu", "float64", 1)
    assert args.kinds == list(bench_peers.KINDS)


def test_the_peers_folder_defaults_to_the_environment_then_dot_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv(bench_peers.ENV_PEERS, str(tmp_path))
    assert bench_peers.parse_arguments([]).peers == tmp_path
    monkeypatch.delenv(bench_peers.ENV_PEERS)
    assert peer_code.default_peers_dir() == ROOT / ".gpu" / "peers"


def test_a_missing_checkout_or_file_is_named(tmp_path):
    reason = peer_code.missing(tmp_path, "d1")
    assert "dllm-reasoning+d1" in reason and "github.com/dllm-reasoning/d1" in reason and "pack_peers.sh" in reason
    (tmp_path / "NVlabs+Fast-dLLM" / "llada").mkdir(parents=True)
    (tmp_path / "NVlabs+Fast-dLLM" / "llada" / "generate.py").write_text("")
    reason = peer_code.missing(tmp_path, "fast_dllm")
    assert "lacks llada/model/__init__.py" in reason and "generate.py," not in reason
    with pytest.raises(FileNotFoundError, match="no checkout ML-GSAI\\+ESPO"):
        peer_code.official_functions(tmp_path, "espo", "espo/espo_trainer.py", ("compute_loss",))


def test_without_checkouts_every_peer_row_says_what_is_missing(tmp_path, one_thread):
    """An empty peers folder: rollout, update and step rows are skipped naming the absent checkout; the LM head
    (no checkout needed) runs, the Triton peers skipped with the reason on a CPU; the published figures labelled."""
    run = bench_peers.Run(tmp_path, "small", torch.device("cpu"), torch.float64, 1)
    rows = bench_peers.run_kinds(run, bench_peers.KINDS)
    assert all(ROW_KEYS <= set(r) for r in rows)
    peer_rows = [r for r in rows if r["kind"] != "head"]
    assert {r["kind"] for r in peer_rows} == {"rollout", "update", "step"}
    for r in peer_rows:
        assert r["status"].startswith("skipped: no checkout ") and str(tmp_path) in r["status"], r
    assert any("JetAstra+SDAR" in r["status"] for r in peer_rows if r["setting"].startswith("sdar"))
    assert any("facebookresearch+SPG" in r["status"] for r in peer_rows if r["kind"] == "update")
    head = {r["provider"]: r for r in rows if r["kind"] == "head"}
    assert head["dllm_fast"]["status"] == "ok" and head["dllm_fast"]["agree"] is True
    assert head["dllm_fast"]["ratio"] == 1.0 and head["naive"]["ratio"] > 0
    if not torch.cuda.is_available():
        assert head["liger fused linear CE"]["status"].startswith("skipped: ")
        assert head["cut cross-entropy"]["status"].startswith("skipped: ")
    assert head["liger cute (published)"]["status"].startswith("published H200 figure, not measured")


def test_rows_print_as_one_json_list(tmp_path, capsys, one_thread):
    rows = bench_peers.main(["--peers", str(tmp_path), "--kinds", "step", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == rows and len(rows) == 3 and {r["provider"] for r in rows} == {
        "dllm_fast", "dllm_fast dual cache", "d1 phases (sum)"}


def test_a_failing_setting_becomes_error_rows_and_the_run_goes_on():
    def fails():
        raise RuntimeError("CUDA out of memory")

    rows = bench_peers.guarded("update", "espo (espo)", ["dllm_fast", "espo compute_loss"], fails)
    assert [r["status"] for r in rows] == ["error: RuntimeError: CUDA out of memory"] * 2


def test_ratio_is_time_over_dllm_fasts_in_the_same_setting():
    row = bench_peers.row
    rows = [row("rollout", "a", "dllm_fast", seconds=2.0), row("rollout", "a", "peer", seconds=6.0),
            row("rollout", "b", "peer", seconds=1.0), row("rollout", "b", "dllm_fast", "skipped: x")]
    bench_peers.with_ratio(rows)
    assert [r.get("ratio") for r in rows] == [1.0, 3.0, None, None]


def test_official_functions_are_compiled_from_the_file_without_their_decorators(tmp_path):
    source = tmp_path / "me+trainer" / "t.py"
    source.parent.mkdir()
    source.write_text(
        "import wandb\nfrom trl import profiling_decorator\n"
        "def helper(x):\n    return torch.as_tensor(x) * 2\n"
        "class Trainer(Base):\n"
        "    @profiling_decorator\n"
        "    def loss(self, x):\n        return helper(x) + self.beta\n"
        "    def other(self):\n        return np.pi\n")
    peer = peer_code.Peer("me/trainer", ("t.py",))
    peer_code.PEERS["test_peer"] = peer
    try:
        functions = peer_code.official_functions(tmp_path, "test_peer", "t.py", ("helper",))
        methods = peer_code.official_functions(tmp_path, "test_peer", "t.py", ("loss", "other"), class_name="Trainer",
                                               extra_globals=functions)
        trainer = peer_code.TrainerStandIn(methods, beta=1.0, args=dict(num_iterations=2))
        assert float(trainer.loss(3)) == 7.0 and trainer.args.num_iterations == 2
        assert trainer.accelerator.gather_for_metrics(torch.ones(2, 2)).shape == (4,)
        with pytest.raises(LookupError, match="defines no missing"):
            peer_code.official_functions(tmp_path, "test_peer", "t.py", ("missing",), class_name="Trainer")
        with pytest.raises(LookupError, match="no class Absent"):
            peer_code.official_functions(tmp_path, "test_peer", "t.py", ("loss",), class_name="Absent")
    finally:
        del peer_code.PEERS["test_peer"]


def test_a_wheel_in_the_peers_folder_is_imported_unless_installed(tmp_path, monkeypatch):
    import importlib.util

    wheel = tmp_path / "einops-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("einops/__init__.py", "SOURCE = 'wheel'\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = sys.modules.pop("einops", None)
    try:
        assert peer_code.wheel_files(tmp_path) == {"einops": wheel}
        installed = importlib.util.find_spec("einops") is not None
        assert peer_code.use_wheels(tmp_path) == ([] if installed else ["einops"])
        if not installed:
            import einops
            assert einops.SOURCE == "wheel"
    finally:
        sys.modules.pop("einops", None)
        if saved is not None:
            sys.modules["einops"] = saved


@pytest.mark.slow  # bash and a fresh python, about 10 s on 2 cores
def test_pack_peers_copies_only_the_files_read(tmp_path):
    checkout = tmp_path / "src" / "ML-GSAI+LLaDA"
    checkout.mkdir(parents=True)
    (checkout / "generate.py").write_text("# sampler\n")
    (checkout / "app.py").write_text("# not read\n")
    (tmp_path / "src" / "einops-0.8.2-py3-none-any.whl").write_bytes(b"zip")
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "pack_peers.sh"), str(tmp_path / "src"), str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "missing: " in result.stdout  # the other peers are absent, and said so
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["ML-GSAI+LLaDA/generate.py", "einops-0.8.2-py3-none-any.whl"]
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer_code.py"), "--files"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert len(listed) == sum(len(p.files) for p in peer_code.PEERS.values()) and "ML-GSAI+LLaDA/generate.py" in listed


# -- with the checkouts ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_peer_agrees_with_dllm_fast_at_small_shapes(one_thread):
    """`bench_peers.py --preset small --device cpu`: every provider runs (float64); greedy tokens equal, loss values
    within 1e-6, gradients within 1e-5 (the official code rounds its log-probs to fp32 and RoPE runs in fp32)."""
    absent = missing_peers()
    if absent:
        pytest.skip("peer checkouts missing: " + "; ".join(absent))
    rows = bench_peers.main(["--peers", str(PEERS), "--json"])
    statuses = {(r["kind"], r["setting"], r["provider"]): r["status"] for r in rows}
    for key, status in statuses.items():
        if key[0] == "head" and ("liger" in key[2] or "cut cross" in key[2] or "quack" in key[2]):
            continue  # Triton (no GPU here) and published figures
        assert status == "ok", (key, status)
    assert {r["kind"] for r in rows} == set(bench_peers.KINDS)
    rollouts = [r for r in rows if r["kind"] == "rollout"]
    assert len(rollouts) == 12 and all(r["tokens_per_s"] > 0 for r in rollouts)
    assert all(r["agree"] is True for r in rollouts if not r["setting"].startswith("sdar sampled"))
    updates = [r for r in rows if r["kind"] == "update"]
    assert {r["provider"] for r in updates} == {"dllm_fast", "d1 compute_loss", "spg compute_loss",
                                                "espo compute_loss"}
    for r in updates:
        assert r["agree"] is True and r["loss_diff"] <= 1e-6 and r["grad_rel"] < 1e-5, r
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 3 and all(r["s_per_prompt"] > 0 for r in steps)
