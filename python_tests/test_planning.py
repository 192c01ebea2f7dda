"""The planner (dllm_fast.planning): accounting that fails when it breaks.

Memory properties from the engine's and the cache's design (streaming flat in n_t, all-graphs linear in it, LoRA's
optimizer state the adapters' size, the KV cache exactly layers x batch x positions x width), FLOPs against
torch's FlopCounterMode and an analytic count, replayed calls equal to calls run, workspaces declared for every
compiled op, and the command line. Tiny presets throughout.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dllm_fast.likelihood import MicroBatching, sample_masks, score
from dllm_fast.models import LLaDAConfig
from dllm_fast.planning.accounting import CATEGORIES, Target
from dllm_fast.planning.gpus import GPU, GPUS
from dllm_fast.planning.step import Session
from dllm_fast.train.config import TrainConfig

CPU = Target("cpu")
TINY = LLaDAConfig.preset("tiny")


def tiny_config(**overrides) -> TrainConfig:
    values = dict(model="tiny", prompts_per_step=2, group_size=4, gen_length=16, block_length=8, diffusion_steps=4,
                  micro_batch=4, objective="vrpo_ol", bf16=False)
    return TrainConfig(**{**values, **overrides})


def session(config: TrainConfig | None = None, **options) -> Session:
    return Session(config or tiny_config(), target=options.pop("target", CPU), **options)


def test_streaming_is_flat_in_n_t_and_all_graphs_doubles():
    """Doubling n_t leaves the streaming update's peak where it was (beyond the pair-sized lp buffers) and doubles
    the activations all-graphs keeps."""
    peaks = {}
    for engine in ("streaming", "all_graphs"):
        with session(engine=engine) as s:
            batch = s.rollout(prompts=1, group_size=4, prompt_length=8).batch
            for n_t in (4, 8):
                update = s.updates(batch, n_t=n_t, batching=MicroBatching(4))["inner update"]
                peaks[engine, n_t] = update
    streaming_growth = peaks["streaming", 8].peak - peaks["streaming", 4].peak
    lp_buffers = 4 * 4 * 16 * 4  # 4 more samples x 4 sequences x 16 positions, fp32: one lp-sized tensor
    assert 0 <= streaming_growth <= 8 * lp_buffers
    activations = {n_t: peaks["all_graphs", n_t].category_peaks["activations"] for n_t in (4, 8)}
    assert activations[8] == pytest.approx(2 * activations[4], rel=0.05)
    assert peaks["all_graphs", 8].peak - peaks["all_graphs", 4].peak > 10 * streaming_growth


def test_lora_optimizer_state_is_the_adapters_size():
    """AdamW keeps two fp32 moments per trainable value: the adapters' with LoRA, every weight's without."""
    for lora in (True, False):
        with session(tiny_config(lora=lora, lora_rank=4)) as s:
            trainable = sum(p.numel() * p.element_size() for p in s.trainable)
            assert s.accountant.memory["optimizer_state"] == 2 * trainable
            if lora:
                assert trainable < 0.2 * sum(p.numel() * 4 for p in s.base.parameters())
            else:
                assert trainable == sum(p.numel() * 4 for p in s.base.parameters())


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_kv_cache_is_layers_batch_positions_width(cache):
    """The rollout's KV cache holds keys and values for every layer, row and position of prompt + generation."""
    sizes = {}
    for prompt_length, gen_length in ((8, 16), (24, 16), (8, 32)):
        config = tiny_config(cache=cache, gen_length=gen_length, diffusion_steps=gen_length // 4)
        with session(config) as s:
            rollout = s.rollout(prompts=2, group_size=4, prompt_length=prompt_length)
            sizes[prompt_length, gen_length] = rollout.phase.category_peaks["kv_cache"]
            rows = 8
            expected = 2 * TINY.n_layers * rows * (prompt_length + gen_length) * TINY.d_model * 4
            assert sizes[prompt_length, gen_length] == expected
    assert sizes[24, 16] > sizes[8, 16] and sizes[8, 32] > sizes[8, 16]


def test_no_cache_allocates_no_kv_cache():
    with session(tiny_config(cache="none")) as s:
        assert s.rollout(prompts=1, group_size=2, prompt_length=8).phase.category_peaks["kv_cache"] == 0


def forward_backward(model, sequences, masks, prompt_length):
    from dllm_fast.ops import masked_logprobs

    noisy = sequences.masked_fill(masks.masked[:, 0], model.mask_token_id)
    hidden = model(noisy)
    rows, positions = masks.scored[:, 0].nonzero(as_tuple=True)
    targets = sequences[rows, prompt_length + positions]
    masked_logprobs(hidden[rows, prompt_length + positions], model.lm_head_weight, targets).sum().backward()
    return int(rows.numel())


def test_flops_equal_flop_counter_and_an_analytic_count():
    """A forward and backward with the fused LM head: the ledger's FLOPs equal FlopCounterMode's on the same run
    (the compiled ops declare theirs) and an analytic count within 1%."""
    from torch.utils.flop_counter import FlopCounterMode

    B, P, L = 4, 8, 24
    with session() as s:
        sequences = torch.randint(0, TINY.mask_token_id, (B, P + L), generator=torch.Generator().manual_seed(0))
        masks = sample_masks(sequences, prompt_length=P, n_t=1, sampler="stratified_l", count="all",
                             generator=torch.Generator().manual_seed(1))
        counter = FlopCounterMode(display=False)
        with counter:
            phase, rows = s.measure("flops", lambda: forward_backward(s.policy, sequences, masks, P))
    d, h, layers, V, S = TINY.d_model, TINY.mlp_hidden_size, TINY.n_layers, TINY.vocab_size, P + L
    linear = 2 * B * S * layers * (4 * d * d + 3 * d * h)
    attention = 4 * B * S * S * d * layers
    analytic = 3 * linear + 3.5 * attention + 4 * 2 * rows * V * d
    assert phase.costs.flops == counter.get_total_flops()
    assert phase.costs.flops == pytest.approx(analytic, rel=0.01)


def test_replayed_calls_cost_and_hold_what_running_them_does():
    """Steps of a rollout and micro-batches of an update replayed from a recorded call give the same FLOPs, bytes
    and kernels as running every call, and the same peak."""
    results = {}
    for replay in (False, True):
        with session() as s:
            if not replay:
                s.replayer.records = _NeverRecords()
            rollout = s.rollout(prompts=2, group_size=4, prompt_length=8)
            phases = s.updates(rollout.batch, n_t=4, batching=MicroBatching(4))
            results[replay] = [rollout.phase, phases["inner update"]]
            calls = s.replayer.calls
        assert (calls["replayed"] > 0) == replay
    for plain, replayed in zip(results[False], results[True]):
        assert replayed.costs.flops == plain.costs.flops
        assert replayed.costs.bytes == plain.costs.bytes
        assert replayed.costs.kernels == plain.costs.kernels
        assert replayed.peak == pytest.approx(plain.peak, rel=0.002)


class _NeverRecords(dict):
    """A record table that forgets: every call runs."""

    def __setitem__(self, key, value):
        pass


def test_every_compiled_op_declares_its_workspace_and_gemm_flops():
    from torch.utils.flop_counter import flop_registry

    from dllm_fast._extension import HAS_EXTENSION
    from dllm_fast.ops.costs import WORKSPACES

    if not HAS_EXTENSION:
        pytest.skip("the compiled ops are not built")
    ops = {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
           if name.startswith("dllm_fast::")}
    assert ops and ops <= set(WORKSPACES), sorted(ops - set(WORKSPACES))
    for name in ("masked_logprobs", "masked_logprobs_backward", "sample_tokens"):
        assert getattr(torch.ops.dllm_fast, name) in flop_registry


def test_workspace_counts_in_the_peak_for_the_planned_device():
    """A masked_logprobs call's peak is its outputs plus the workspace its kernel declares, for the device planned
    (the CUDA kernel allocates less than the CPU one for fp32; chunks sized for that device)."""
    from dllm_fast.ops import masked_logprobs
    from dllm_fast.ops.backend import default_chunk_size
    from dllm_fast.ops.costs import workspace

    M, d, V = 64, 32, 1000
    peaks = {}
    for device_type, gpu in (("cpu", None), ("cuda", GPUS["h100"])):
        with session(target=Target(device_type, gpu)) as s:
            hidden = torch.empty(M, d)
            weight = torch.empty(V, d)
            targets = torch.zeros(M, dtype=torch.long)
            phase, _ = s.measure("op", lambda: masked_logprobs(hidden, weight, targets))
            chunk = default_chunk_size(M, V, torch.device(device_type))
            expected = workspace("masked_logprobs", device_type, (hidden, weight, targets, chunk)).bytes + 2 * M * 4
            peaks[device_type] = phase.peak - phase.start
            assert peaks[device_type] == pytest.approx(expected, abs=2 * 512)
    assert peaks["cpu"] != peaks["cuda"]


def test_gpu_table_peaks():
    h100 = GPUS["h100"]
    assert h100.peak_flops(torch.bfloat16) == pytest.approx(989.4e12)
    assert h100.peak_flops(torch.float32) == pytest.approx(66.9e12)
    assert h100.peak_flops(torch.float32, allow_tf32=True) == pytest.approx(494.7e12)
    assert GPUS["h200"].memory > h100.memory and GPUS["h200"].bandwidth > h100.bandwidth


@pytest.mark.slow
def test_plan_verdict_and_largest_settings_on_a_small_gpu():
    """On a GPU just too small for the step, the plan says it does not fit; the largest micro-batch it names
    fits when planned, and twice it does not."""
    from dllm_fast.planning.planner import plan_step

    config = tiny_config(micro_batch=8)
    roomy = plan_step(config, gpu=GPU("roomy", "test GPU", 1e12, 1e12, 1e12, 1e12, 10**12), prompt_length=8,
                      search=False)
    assert roomy.fits
    small = GPU("small", "test GPU", 1e12, 1e12, 1e12, 1e12, int(roomy.peak * 0.999))
    plan = plan_step(config, gpu=small, prompt_length=8)
    assert plan.fits is False and plan.peak == roomy.peak
    best = plan.largest["micro_batch"]
    assert best is not None and best < 8
    assert plan_step(tiny_config(micro_batch=best), gpu=small, prompt_length=8, search=False).fits
    assert not plan_step(tiny_config(micro_batch=2 * best), gpu=small, prompt_length=8, search=False).fits


@pytest.mark.slow
def test_extrapolated_update_matches_a_direct_plan():
    """The updates planned at two small n_t and extrapolated match planning them at the large n_t directly (the
    model's work per pair is the same; the LM head's rows follow the stratified masks, a few percent apart)."""
    from dllm_fast.planning.fit import extrapolate
    from dllm_fast.planning.step import probe_n_t, two_pass_line

    config = tiny_config(gen_length=32, block_length=8, diffusion_steps=8)
    with session(config) as s:
        batch = s.rollout(prompts=2, group_size=4, prompt_length=8).batch
        batching = MicroBatching(4)
        probes = probe_n_t(config, batch.num_rollouts, batching.micro_batch)
        line = two_pass_line(batching)  # the probes' setting: n_t = 32 > 4 takes two passes too
        fresh = s.updates(batch, n_t=probes[0], batching=line)
        low, high = (s.updates(batch, n_t=n, batching=line) for n in probes)
        direct = s.updates(batch, n_t=32, batching=batching)
    for name in ("inner update", "reference scoring"):
        if not direct[name].runs:
            continue
        guess = extrapolate(low[name], high[name], *probes, 32, fresh[name])
        assert guess.costs.flops == pytest.approx(direct[name].costs.flops, rel=0.03)
        assert guess.peak == pytest.approx(direct[name].peak, rel=0.03)


def test_plan_leaves_real_scoring_working():
    """A plan caches no fake tensor in the library: real scoring with the same lengths works after it."""
    from dllm_fast.models import LLaDAModel

    with session() as s:
        batch = s.rollout(prompts=2, group_size=4, prompt_length=8).batch
        s.updates(batch, n_t=2, batching=MicroBatching(4))  # draws masks: fingerprints sequences of 24 positions
    model = LLaDAModel(TINY)
    sequences = torch.randint(0, TINY.mask_token_id, (2, 24))
    masks = sample_masks(sequences, prompt_length=8, n_t=2, sampler="stratified_l", count="all",
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = score(model, sequences, masks, micro_batch=2)
    assert torch.isfinite(lp).all() and type(lp) is torch.Tensor


def test_a_plan_after_real_scoring_of_the_same_lengths_works():
    """The reverse order: real masks of 24 positions first (the library caches their fingerprint multipliers as a
    real tensor), then a plan that draws masks of 24 positions on fake tensors."""
    from dllm_fast.likelihood.masks import sequence_fingerprint

    sequence_fingerprint(torch.randint(0, TINY.mask_token_id, (2, 24)))
    with session() as s:
        batch = s.rollout(prompts=2, group_size=4, prompt_length=8).batch
        s.updates(batch, n_t=2, batching=MicroBatching(4))


def test_phase_memory_adds_up_by_category():
    with session() as s:
        rollout = s.rollout(prompts=2, group_size=4, prompt_length=8)
        parameters = sum(p.numel() * p.element_size() for p in s.base.parameters())
        assert rollout.phase.memory["parameters"] == parameters
        assert rollout.phase.peak == sum(rollout.phase.memory[c] for c in CATEGORIES)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dllm_fast", "plan", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_cli_plans_a_tiny_step_as_json():
    out = run_cli("--model", "tiny", "--prompt-length", "8", "--gen-length", "16", "--block-length", "8",
                  "--diffusion-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4",
                  "--gpu", "a100-40gb", "--search", "false", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["gpu"]["name"] == "a100-40gb" and plan["fits"] is True
    assert set(plan["phases"]) == {"rollout", "old-policy scoring", "reference scoring", "inner update",
                                   "optimizer step"}
    assert plan["phases"]["inner update"]["flops"] > 0 and "estimate" in plan["label"].lower()


def test_cli_refuses_an_unknown_gpu_by_name():
    out = run_cli("--gpu", "h300")
    assert out.returncode == 2
    assert "--gpu 'h300'" in out.stderr and "h100" in out.stderr


def test_reading_a_model_output_is_an_error_not_an_invented_value():
    """The plan never makes up a value the model computes: reading one is a readable error."""
    from dllm_fast.planning.planner import _readable_data_errors

    with pytest.raises(RuntimeError, match="cannot know"):
        with _readable_data_errors(), session() as s:
            hidden = s.base(torch.zeros(1, 4, dtype=torch.long))
            assert torch.isfinite(hidden).all()  # finiteness is assumed: no error
            hidden.sum().item()


def test_the_one_pass_update_costs_a_forward_less_per_pair():
    """A sequence-local objective (VRPO-OL) in micro-batches of whole sequences: no scoring pass, so a full
    fine-tune's update does forward + backward (about 3 forwards of FLOPs) where two passes do 4."""
    flops = {}
    with session() as s:
        batch = s.rollout(prompts=1, group_size=4, prompt_length=8).batch
        for one_pass in (True, False):
            update = s.updates(batch, n_t=4, batching=MicroBatching(4, one_pass=one_pass))["inner update"]
            flops[one_pass] = update.costs.flops
    assert flops[True] / flops[False] == pytest.approx(0.75, abs=0.03)
