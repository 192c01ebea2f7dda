"""dllm_fast against the code users run today: each official peer a provider beside dllm_fast, same weights, same
inputs, one run. Rows say whether the two agree (tokens at T = 0, loss values) and how their times compare.

    python benchmarks/bench_peers.py --peers DIR --preset small --device cpu --json   # every provider, ~20 s
    python benchmarks/bench_peers.py --peers .gpu/peers --preset 8b --device cuda     # LLaDA-8B / SDAR-8B shapes
    python benchmarks/bench_peers.py --plan --gpu h200                                # PLANNER ESTIMATES of the
                                                                                      # 8b rows (~2 min of CPU)

DIR (default $DLLM_FAST_PEERS, else .gpu/peers/) holds one checkout per repository named <owner>+<name>
(benchmarks/peer_code.py lists them and the files read; benchmarks/pack_peers.sh copies only those) and the
pure-Python wheels the peers import (einops, Liger-Kernel, Cut Cross-Entropy). A peer whose checkout is absent
gives rows with status "skipped: <why>"; nothing of the peers is part of dllm_fast (peer_code.py loads them).

Kinds of rows (--kinds), each a setting run by dllm_fast and by its peer on one random model (the peer's model
shares dllm_fast's weight tensors):

- rollout: LLaDA's generate.py (no cache), Fast-dLLM's generate_with_prefix_cache, generate_with_dual_cache and
  dual cache with threshold 0.9, SDAR's block_diffusion_generate (greedy, and sampled at T = 1 with its dynamic
  rule). LLaDA-architecture peers run the official LLaDA model file (Fast-dLLM's llada/model, the Hugging Face
  LLaDA code plus its caches); Fast-dLLM's and SDAR's generate take one prompt a call (batch 1), so they run each
  prompt in turn while dllm_fast and LLaDA's generate take the batch. SDAR's official modeling file needs
  transformers near 4.52 and flash-attn (imported at module level), neither of which this machine or the GPU
  machine has, so SDAR's official decoding loop runs over a stand-in with the official model's outputs:
  transformers' Qwen3ForCausalLM with the SDAR weights and the block-causal mask the loop passes (SDAR's model is
  Qwen3's with that mask; python_tests/test_sdar_model.py checks dllm_fast's SDAR against it), its KV cache
  trimmed after each step that does not store (the loop's store_kv=False).
  Agreement at T = 0 under dllm_fast's conventions (README): the mask token is never decoded, so the peers'
  model gives it a logit of -inf (the settings then agree: LLaDA's and Fast-dLLM's confidences are normalised
  over the same tokens); prompts of equal length (no padding: blocks align alike); for SDAR, prompt and
  completion lengths are multiples of the block (the official loop decodes to a block boundary, dllm_fast ends
  the last block at the completion). SDAR's generate has no greedy mode with confidences: at top_k = 1 every
  confidence is 1, so its dynamic rule decodes a whole block in one step; dllm_fast runs the same (one step per
  block, T = 0) and the tokens are compared. Its sampled setting (T = 1, steps = block, threshold 0.85 on both)
  compares time only.
- update: one inner update of the official d1 (diffu-GRPO), SPG and ESPO loss code, its loss and backward, on
  the same batch; dllm_fast's objective (`objectives.get`, the options that reproduce the code) runs
  `Objective.backward` on the masks the official code drew (recorded from the noisy sequences its model saw),
  with the old and reference policies' lp scored by each side on its own. The loss values must agree to 1e-6
  and the gradients (accumulated into the same parameters) are compared. Advantages: dllm_fast's, with the
  code's rule (the official ones are computed in the trainer's rollout method, which is not driven), given to
  both. The second of mu = 2 inner updates: the old policy a perturbed copy, the reference another (a KL for d1
  and ESPO; SPG has none). The 8b preset fits an 80 GB GPU: the old policy is the policy itself, and the batch
  is 2 sequences (a group of 2; ESPO's code keeps the graphs of its 4 forwards).
- step: a whole diffu-GRPO step per prompt. d1's trainer (TRL 0.16's GRPOTrainer with accelerate and
  DeepSpeed) cannot be driven without its launcher, so its step is the sum of its phases run in its order: the
  trainer's own `generate` for the group, the old and reference policies' per-token log-probs for the mu
  iterations (`_get_per_token_logps`), then mu times `compute_loss` and backward. dllm_fast's is its trainer's
  phases (dllm_fast.train.step: roll_out, plan_updates, the objective's backward with the reference scored),
  once with the same sampler settings (no cache) and once with its dual cache. The optimizer step, the same
  AdamW for both, is left out of both. Rollouts sample at T = 0.9 (d1's), so tokens are not compared.
- head: the LM head's per-token log-probs forward and backward: dllm_fast.masked_logprobs, plain PyTorch,
  Liger's fused linear cross-entropy and Cut Cross-Entropy (both Triton: on a CPU they are skipped, and why).
  Liger's CuTe kernels and QuACK are not carried to the GPU machine (81 MB and a CUTLASS DSL stack against the
  64 MiB a run carries); their rows quote the published H200 figures (issue 38) and say so.

Each row: kind, setting, provider, status, seconds (median over --repeats after a warm-up, the providers of a
setting timed in turns; a rollout's and a step's warm-up decode one block), ratio (seconds / dllm_fast's seconds in that setting), agree (tokens or loss, None where
not compared), and per kind: tokens_per_s (rollout), ms_per_update, loss, loss_diff, grad_rel (update),
s_per_prompt (step), ms (head). --json prints the rows as one JSON list.

--plan prints the planner's estimates for the 8b preset's GPU rows (dllm_fast.planning; the peers priced as
their code runs: benchmarks/plan_peers.py), each labelled PLANNER ESTIMATE. The models the peers run on
dllm_fast's weights are in benchmarks/peer_models.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import peer_code  # noqa: E402
import peer_models  # noqa: E402
import plan_peers  # noqa: E402
from common import add_ratio, synchronize, time_interleaved, write_results  # noqa: E402
from peer_settings import (D1_TEMPERATURE, DLLM_OPTIONS, KINDS, OFFICIAL_LOSSES, PRESETS, SDAR_THRESHOLD,  # noqa: E402
                           STEP_GROUP, THRESHOLD, print_rows)

ENV_PEERS = "DLLM_FAST_PEERS"

SMALL_VOCAB = dict(vocab_size=2048, mask_token_id=2047, eos_token_id=2046, eot_token_id=2045)
LLADA_SMALL = dict(d_model=128, n_layers=2, n_heads=4, mlp_hidden_size=384, max_sequence_length=512,
                   pad_token_id=2046, **SMALL_VOCAB)
SDAR_SMALL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=2046, **SMALL_VOCAB)
LOSS_TOLERANCE = 1e-6  # |loss_dllm_fast - loss_official| <= LOSS_TOLERANCE * max(1, |loss|), float64
LOW_PRECISION_TOLERANCE = 2e-2  # the same in bf16 / fp32 (different kernels round differently)
# The head's log-probs against plain PyTorch in the run's dtype: dllm_fast returns fp32 log-probs, so float64
# agrees to fp32's rounding; bf16 to its own.
HEAD_TOLERANCE = {True: 1e-5, False: 5e-2}
# Published H200 figures of the LM head kernels that cannot be carried to the GPU machine (issue 38: bf16, 8,192
# rows, d 4,096, V 128,256; plain PyTorch at that shape: 1.33-1.37x their time).
PUBLISHED_HEAD = [("liger cute (published)", 34e-3, 36e-3), ("quack chunked (published)", 34e-3, 36e-3)]


# ---------------------------------------------------------------------------------------------------------
# the run: arguments, models


@dataclasses.dataclass(frozen=True)
class Run:
    peers: Path
    preset: str
    device: torch.device
    dtype: torch.dtype
    repeats: int
    seed: int = 0

    @property
    def shapes(self) -> dict:
        return PRESETS[self.preset]

    @property
    def float64(self) -> bool:
        return self.dtype == torch.float64


@functools.lru_cache(maxsize=None)
def llada_model(run: Run, seed: int = 0):
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    name = run.shapes["llada"]
    config = LLaDAConfig(**LLADA_SMALL) if name == "peers-small" else LLaDAConfig.preset(name)
    return LLaDAModel.with_random_weights(config, dtype=run.dtype, device=run.device, seed=run.seed + seed).eval()


@functools.lru_cache(maxsize=None)
def reference_model(run: Run):
    return perturbed(llada_model(run), run.seed + 7)


def perturbed(model, seed: int, scale: float = 0.02):
    """A copy with every weight moved by `scale` of its standard deviation (an old or reference policy)."""
    other = copy.deepcopy(model)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.float().std() * torch.randn(p.shape, generator=generator, device=p.device).to(p.dtype))
    return other.requires_grad_(False).eval()


@functools.lru_cache(maxsize=None)
def sdar_model(run: Run):
    from dllm_fast.models import SDARConfig, SDARModel

    name = run.shapes["sdar"]
    config = SDARConfig.preset("sdar-8b" if name == "peers-small" else name)
    if name == "peers-small":
        config = dataclasses.replace(config, **SDAR_SMALL)
    config.block_size = run.shapes["sdar_block"]
    return SDARModel.with_random_weights(config, dtype=run.dtype, device=run.device, seed=run.seed).eval()


# ---------------------------------------------------------------------------------------------------------
# rows


def row(kind: str, setting: str, provider: str, status: str = "ok", **values) -> dict:
    return dict(kind=kind, setting=setting, provider=provider, status=status, **values)


def skipped(kind: str, setting: str, providers: list[str], reason: str) -> list[dict]:
    return [row(kind, setting, p, f"skipped: {reason}") for p in providers]


def guarded(kind: str, setting: str, providers: list[str], build: Callable[[], list[dict]]) -> list[dict]:
    """build()'s rows, or if it raises, one row per provider with status "error: ..." (the traceback on stderr):
    on a GPU machine one peer's failure must not cost the others' rows."""
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - reported in the rows
        traceback.print_exc()
        return [row(kind, setting, p, f"error: {type(error).__name__}: {error}"[:400]) for p in providers]


def timed(runs: dict[str, Callable[[], Any]], run: Run) -> dict[str, float]:
    """Median seconds of each run, the runs taking turns (after the caller's warm-up)."""
    timings = time_interleaved(runs, run.device, repeats=run.repeats)
    return {name: timing.median_s for name, timing in timings.items()}


def with_ratio(rows: list[dict]) -> list[dict]:
    """ratio = seconds / dllm_fast's seconds of the same kind and setting."""
    add_ratio(rows, "ratio", "seconds", baseline={"provider": "dllm_fast"}, match=("kind", "setting"))
    return rows


# ---------------------------------------------------------------------------------------------------------
# rollouts


def llada_prompts(run: Run, model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(run.seed + 1)
    s = run.shapes
    return torch.randint(0, model.config.eos_token_id, (s["batch"], s["prompt"]), generator=generator).to(run.device)


def rollout_rows(run: Run) -> list[dict]:
    rows = []
    llada_settings = [
        ("no cache", "llada", "llada generate.py", dict(cache="none"), None),
        ("prefix cache", "fast_dllm", "fast-dllm generate_with_prefix_cache", dict(cache="prefix"),
         ("generate_with_prefix_cache", None)),
        ("dual cache", "fast_dllm", "fast-dllm generate_with_dual_cache", dict(cache="dual"),
         ("generate_with_dual_cache", None)),
        (f"dual cache, threshold {THRESHOLD}", "fast_dllm", "fast-dllm generate_with_dual_cache",
         dict(cache="dual", threshold=THRESHOLD), ("generate_with_dual_cache", THRESHOLD)),
    ]
    for setting, peer, provider, options, fast in llada_settings:
        reason = peer_code.missing(run.peers, peer) or (peer_code.missing(run.peers, "fast_dllm")
                                                        if peer == "llada" else None)
        if reason:
            rows += skipped("rollout", setting, ["dllm_fast", provider], reason)
            continue
        rows += guarded("rollout", setting, ["dllm_fast", provider],
                        functools.partial(llada_rollout, run, setting, provider, options, fast))
    reason = peer_code.missing(run.peers, "sdar")
    for setting in ("sdar greedy (one step a block)", f"sdar sampled T=1, threshold {SDAR_THRESHOLD}"):
        if reason:
            rows += skipped("rollout", setting, ["dllm_fast", "sdar block_diffusion_generate"], reason)
        else:
            rows += guarded("rollout", setting, ["dllm_fast", "sdar block_diffusion_generate"],
                            functools.partial(sdar_rollout, run, setting, greedy=setting.startswith("sdar greedy")))
    return with_ratio(rows)


def llada_rollout(run: Run, setting: str, provider: str, options: dict, fast) -> list[dict]:
    import dllm_fast

    s = run.shapes
    model = llada_model(run)
    peer_model = peer_models.NoMaskToken(peer_models.official_llada(run.peers, model), model.mask_token_id)
    prompts = llada_prompts(run, model)
    block, per_block = s["block"], s["steps"] // (s["gen"] // s["block"])

    def ours(blocks: int):
        steps = None if "threshold" in options else per_block * blocks
        return dllm_fast.generate(model, prompts, None, gen_length=blocks * block, block_length=block, steps=steps,
                                  temperature=0.0, generator=torch.Generator(run.device).manual_seed(0),
                                  **options).completion_ids

    if fast is None:
        llada = peer_models.llada_generate_module(run.peers)

        def theirs(blocks: int):
            x = llada.generate(peer_model, prompts, attention_mask=None, steps=per_block * blocks,
                               gen_length=blocks * block, block_length=block, temperature=0.0,
                               remasking="low_confidence", mask_id=model.mask_token_id)
            return x[:, prompts.shape[1]:]
    else:
        function, threshold = getattr(peer_models.fast_dllm_module(run.peers), fast[0]), fast[1]

        def theirs(blocks: int):  # Fast-dLLM's generate takes one prompt (batch 1): each prompt in turn
            rows = [function(peer_model, prompts[n:n + 1], steps=per_block * blocks, gen_length=blocks * block,
                             block_length=block, temperature=0.0, remasking="low_confidence",
                             mask_id=model.mask_token_id, threshold=threshold)[0] for n in range(prompts.shape[0])]
            return torch.cat(rows)[:, prompts.shape[1]:]

    return rollout_pair(run, setting, provider, ours, theirs, blocks=s["gen"] // block, batch=prompts.shape[0],
                        block=block, compare=True)


def rollout_pair(run: Run, setting: str, provider: str, ours, theirs, *, blocks: int, batch: int, block: int,
                 compare: bool) -> list[dict]:
    """Time ours(blocks) and theirs(blocks) in turns (--repeats rounds, after a one-block warm-up of each) and
    compare the tokens of their last calls."""
    calls = {"dllm_fast": ours, provider: theirs}
    seconds, tokens = {name: [] for name in calls}, {}
    with torch.no_grad():
        for call in calls.values():
            call(1)
        for _ in range(run.repeats):
            for name, call in calls.items():
                synchronize(run.device)
                started = time.perf_counter()
                tokens[name] = call(blocks).cpu()
                synchronize(run.device)
                seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ours_tokens, theirs_tokens = tokens["dllm_fast"], tokens[provider]
    agree = bool(torch.equal(ours_tokens, theirs_tokens)) if compare else None
    equal = float((ours_tokens == theirs_tokens).double().mean()) if compare else None
    return [row("rollout", setting, name, seconds=median[name], tokens_per_s=batch * blocks * block / median[name],
                agree=agree, tokens_equal=equal) for name in calls]


def sdar_rollout(run: Run, setting: str, *, greedy: bool) -> list[dict]:
    import dllm_fast

    s = run.shapes
    model = sdar_model(run)
    stand_in = peer_models.SDARStandIn(peer_models.qwen3_stand_in(model), model.mask_token_id)
    generate = peer_models.sdar_generate_module(run.peers).block_diffusion_generate
    block, gen = s["sdar_block"], s["sdar_gen"]
    prompts = torch.randint(0, model.eos_token_id, (s["batch"], s["sdar_prompt"]),
                            generator=torch.Generator().manual_seed(run.seed + 2)).to(run.device)
    if greedy:  # top_k = 1: every confidence is 1, a block per step; dllm_fast: one step a block, T = 0
        ours_options = dict(steps=gen // block, temperature=0.0)
        theirs_options = dict(temperature=1.0, top_k=1, denoising_steps=block)
    else:
        ours_options = dict(steps=gen, threshold=SDAR_THRESHOLD, temperature=1.0)
        theirs_options = dict(temperature=1.0, top_k=0, denoising_steps=block)

    def ours(blocks: int):
        options = dict(ours_options, steps=blocks * ours_options["steps"] // (gen // block))
        return dllm_fast.generate(model, prompts, None, gen_length=blocks * block, block_length=block, cache="block",
                                  generator=torch.Generator(run.device).manual_seed(0), **options).completion_ids

    def theirs(blocks: int):  # block_diffusion_generate takes one prompt: each in turn
        rows = [generate(stand_in, {"input_ids": prompts[n:n + 1]}, mask_id=model.mask_token_id,
                         gen_length=blocks * block, block_length=block, remasking_strategy="low_confidence_dynamic",
                         confidence_threshold=SDAR_THRESHOLD, **theirs_options) for n in range(prompts.shape[0])]
        return torch.cat(rows)[:, prompts.shape[1]:prompts.shape[1] + blocks * block]

    return rollout_pair(run, setting, "sdar block_diffusion_generate", ours, theirs, blocks=gen // block,
                        batch=prompts.shape[0], block=block, compare=greedy)


# ---------------------------------------------------------------------------------------------------------
# one update: the official losses


@dataclasses.dataclass
class UpdateCase:
    """A batch of rollouts, the policy and its old / reference copies, each with its official twin."""

    sequences: torch.Tensor
    prompt_length: int
    completion_mask: torch.Tensor  # bool [N, L]
    rewards: torch.Tensor
    policy: Any
    old: Any
    ref: Any
    twins: dict


def update_case(run: Run) -> UpdateCase:
    from dllm_fast.contracts import completion_mask

    s = run.shapes
    model = llada_model(run)
    model.train(False)
    config = model.config
    generator = torch.Generator().manual_seed(run.seed + 3)
    N, P, L = s["sequences"], s["update_prompt"], s["completion"]
    sequences = torch.randint(0, config.eos_token_id, (N, P + L), generator=generator)
    sequences[0, P + L // 2:] = config.eos_token_id  # two answers that end early: EOS padding
    sequences[N // 2, P + 3 * L // 4:] = config.eos_token_id
    rewards = (torch.rand(N, generator=generator) > 0.5).to(torch.float32)
    group = s["group"]
    rewards[::group] = 1.0 - rewards[1::group]  # every group has a signal
    sequences = sequences.to(run.device)
    old = perturbed(model, run.seed + 8) if s["old"] == "perturbed" else model
    ref = reference_model(run)
    twin = functools.partial(peer_models.official_llada, run.peers)
    twins = {"policy": twin(model), "ref": twin(ref)}
    twins["old"] = twins["policy"] if old is model else twin(old)
    return UpdateCase(sequences, P, completion_mask(sequences[:, P:], config.eos_token_id), rewards.to(run.device),
                      model, old, ref, twins)


@contextlib.contextmanager
def official_losses(run: Run):
    """While the official loss code runs: its warnings silenced (autocast("cuda") on a CPU, transformers 5's
    deprecations), and in a float64 run float64 as torch's default dtype, since the code makes its buffers in
    the default dtype (float32; ESPO writes float64 cross-entropies into one, which fails)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if run.float64 else saved)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_default_dtype(saved)


ESPO_NUM_MC = 2  # n_t = 4: two complementary pairs


def official_trainer(run: Run, name: str, mu: int, update_index: int, mask_id: int):
    peer, relative, class_name, methods, functions = OFFICIAL_LOSSES[name]
    extra = peer_code.official_functions(run.peers, peer, relative, functions) if functions else {}
    found = peer_code.official_functions(run.peers, peer, relative, methods, class_name=class_name,
                                         extra_globals=extra)
    if name == "diffu_grpo":
        return peer_code.TrainerStandIn(found, args=dict(num_iterations=mu, p_mask_prompt=0.15, mask_id=mask_id,
                                                         cfg_scale=0.0, fp16=False),
                                        beta=0.04, epsilon=0.5, num_iterations=mu, _step=update_index)
    if name == "spg":
        return peer_code.TrainerStandIn(found, args=dict(
            num_iterations=mu, forward_type="block_random", num_t=2, min_t=0.0, max_t=1.0, block_length=32,
            use_mask_prompt=True, p_mask_prompt=0.15, mask_id=mask_id, cfg_scale=0.0, logp_estimation="mix",
            eubo_beta=1.5, mix_weight=0.5), beta=0.0, _step=update_index)
    return peer_code.TrainerStandIn(
        found, args=dict(num_iterations=mu, gradient_accumulation_steps=1), num_mc=ESPO_NUM_MC, num_iterations=mu,
        epsilon_low=0.2, epsilon_high=0.2, beta=1e-3, _step=update_index + 1,
        processing_class=types.SimpleNamespace(mask_token_id=mask_id),
        model=types.SimpleNamespace(config=types.SimpleNamespace(name_or_path="GSAI-ML/LLaDA-8B-Instruct")))


def official_inputs(run: Run, name: str, trainer, case: UpdateCase, advantages: torch.Tensor, mu: int) -> dict:
    """The inputs dict the official compute_loss reads, the old and reference terms scored by the official code
    (under no_grad, on the same mask seeds)."""
    P = case.prompt_length
    ids, L = case.sequences, case.sequences.shape[1] - P
    inputs = dict(prompt_ids=ids[:, :P], prompt_mask=torch.ones_like(ids[:, :P]), completion_ids=ids[:, P:],
                  completion_mask=case.completion_mask.int(), advantages=advantages)
    expanded = ids.unsqueeze(0).expand(mu, -1, -1)
    with torch.no_grad(), official_losses(run):
        if name == "diffu_grpo":
            inputs["mask_seeds"] = [1234 + k for k in range(mu)]
            inputs["old_per_token_logps"] = trainer._get_per_token_logps(
                peer_models.Quiet(case.twins["old"]), expanded, L, inputs["mask_seeds"])
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps(
                peer_models.Quiet(case.twins["ref"]), expanded, L, inputs["mask_seeds"])
        elif name == "spg":
            inputs["mask_seeds"] = [1234 + k for k in range(mu)]
            inputs["reward_mask"] = advantages > 0
        else:
            inputs["mask_seeds"] = (1234 + torch.arange(mu * ESPO_NUM_MC)).reshape(1, mu, ESPO_NUM_MC)
            inputs["old_per_token_logps"] = trainer._get_elbo_by_chunk(
                peer_models.Quiet(case.twins["old"]), expanded, L, inputs["mask_seeds"], ids.device)
            inputs["ref_per_token_logps"] = trainer._get_elbo_by_chunk(
                peer_models.Quiet(case.twins["ref"]), expanded, L, inputs["mask_seeds"], ids.device)
    return inputs


def recorded_masks(name: str, noisy: list[torch.Tensor], case: UpdateCase, mask_id: int, n_t: int):
    """dllm_fast's MonteCarloMasks for the noisy sequences the official loss fed its model: which positions it
    masked, with the weights of the sampler that reproduces the code (mean_field, block, complementary)."""
    from dllm_fast.likelihood import MonteCarloMasks

    N, S = case.sequences.shape
    P = case.prompt_length
    fed = torch.cat(noisy)
    if name == "spg":  # one forward of the N x num_t samples, row n * num_t + j
        masked = fed.reshape(N, -1, S) == mask_id
    else:  # one forward per sample (ESPO: the pair's two halves in turn)
        masked = (fed.reshape(-1, N, S) == mask_id).permute(1, 0, 2)
    if masked.shape[1] != n_t:
        raise RuntimeError(f"the official {name} loss fed its model {masked.shape[1]} samples per sequence; "
                           f"dllm_fast's objective takes n_t={n_t}")
    masked &= case.sequences[:, None, :] != mask_id
    counted = (case.completion_mask if name != "espo" else torch.ones_like(case.completion_mask))
    chosen = masked[..., P:] & counted[:, None, :]
    size = chosen.sum(-1).double()
    lengths = counted.sum(-1, keepdim=True).double()
    if name == "diffu_grpo":
        weight, t, sampler = torch.ones_like(size), torch.ones_like(size), "mean_field"
    elif name == "spg":
        weight, t, sampler = lengths / size, size / lengths, "block"
    else:
        weight = torch.where(size > 0, (lengths + 1) / size.clamp_min(1), 0.0)
        t, sampler = size / (lengths + 1), "complementary"
    return MonteCarloMasks(masked=masked.contiguous(), counted=counted.clone(), weight=weight, t=t,
                           num_masked=chosen.sum(-1), prompt_length=P, sampler=sampler)


def update_rows(run: Run) -> list[dict]:
    rows = []
    case = None
    for name, (peer, *_rest) in OFFICIAL_LOSSES.items():
        setting = f"{name} ({peer})"
        provider = f"{peer} compute_loss"
        reason = peer_code.missing(run.peers, peer) or peer_code.missing(run.peers, "fast_dllm")
        if reason:
            rows += skipped("update", setting, ["dllm_fast", provider], reason)
            continue
        def build(name=name, setting=setting, provider=provider):
            nonlocal case
            case = case or update_case(run)
            return one_update(run, name, setting, provider, case)

        rows += guarded("update", setting, ["dllm_fast", provider], build)
    return with_ratio(rows)


def one_update(run: Run, name: str, setting: str, provider: str, case: UpdateCase) -> list[dict]:
    from dllm_fast import objectives
    from dllm_fast.contracts import RolloutBatch
    from dllm_fast.likelihood import score
    from dllm_fast.objectives import InnerUpdate

    mu, index = run.shapes["inner_updates"], run.shapes["inner_updates"] - 1  # the last of mu inner updates
    model, mask_id = case.policy, case.policy.mask_token_id
    objective = objectives.get(name, **DLLM_OPTIONS[name])
    batch = RolloutBatch(case.sequences, None, case.prompt_length, case.completion_mask, case.rewards,
                         run.shapes["group"])
    advantages = objective.advantages(batch).to(torch.float32)
    trainer = official_trainer(run, name, mu, index, mask_id)
    inputs = official_inputs(run, name, trainer, case, advantages, mu)
    recorder = peer_models.Recorder(case.twins["policy"])

    def theirs():
        model.zero_grad(set_to_none=True)
        with official_losses(run):
            loss = trainer.compute_loss(recorder, inputs)
        loss.backward()
        return loss.detach()

    loss_theirs = theirs()  # the warm-up records the masks
    grad_theirs = {key: None if grad is None else grad.clone() for key, grad in dllm_fast_grads(model).items()}
    masks = recorded_masks(name, recorder.inputs, case, mask_id, objective.config.n_t)
    recorder.inputs.clear()
    micro_batch = run.shapes["micro_batch"]
    with torch.no_grad():
        lp_old = score(case.old, case.sequences, masks, micro_batch=micro_batch) if objective.uses_old_policy \
            else None
        lp_ref = score(case.ref, case.sequences, masks, micro_batch=micro_batch) if objective.needs_reference \
            else None
    update = InnerUpdate(masks, lp_old=lp_old)

    def ours():
        model.zero_grad(set_to_none=True)
        return objective.backward(model, batch, update, lp_ref=lp_ref, micro_batch=micro_batch).loss

    loss_ours = float(ours())
    grad_rel = relative_difference(dllm_fast_grads(model), grad_theirs)

    def ours_timed():
        ours()
        recorder.inputs.clear()

    def theirs_timed():
        theirs()
        recorder.inputs.clear()

    seconds = timed({"dllm_fast": ours_timed, provider: theirs_timed}, run)
    model.zero_grad(set_to_none=True)
    loss_theirs = float(loss_theirs)
    tolerance = LOSS_TOLERANCE if run.float64 else LOW_PRECISION_TOLERANCE
    diff = abs(loss_ours - loss_theirs)
    agree = diff <= tolerance * max(1.0, abs(loss_theirs))
    common = dict(agree=agree, loss_diff=diff, grad_rel=grad_rel, n_t=masks.n_t, sequences=masks.num_sequences)
    return [row("update", setting, "dllm_fast", seconds=seconds["dllm_fast"],
                ms_per_update=1e3 * seconds["dllm_fast"], loss=loss_ours, **common),
            row("update", setting, provider, seconds=seconds[provider], ms_per_update=1e3 * seconds[provider],
                loss=loss_theirs, **common)]


def dllm_fast_grads(model) -> dict[str, torch.Tensor]:
    """The gradient of each weight under its official name: a fused projection's part is its rows of the fused
    weight's gradient (dllm_fast.models.layers.FusedLinear)."""
    from dllm_fast.models.layers import FusedLinear, ProjectionSlice

    grads = {}
    for name, module in model.named_modules():
        if isinstance(module, ProjectionSlice):
            grad = module.fused.weight.grad
            grads[f"{name}.weight"] = None if grad is None else grad[module.start:module.stop]
        elif not isinstance(module, FusedLinear):
            grads.update({f"{name}.{key}": p.grad for key, p in module.named_parameters(recurse=False)})
    return grads


def relative_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """||ours - theirs|| / ||theirs|| over every weight (by official name; a missing gradient counts as 0)."""
    if set(ours) != set(theirs):
        raise ValueError(f"the models' weights differ: {sorted(set(ours) ^ set(theirs))}")
    difference = norm = 0.0
    for name, b in theirs.items():
        a = ours[name]
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        difference += float(((a.double() - b.double()) ** 2).sum())
        norm += float((b.double() ** 2).sum())
    return math.sqrt(difference / norm) if norm > 0 else math.sqrt(difference)


# ---------------------------------------------------------------------------------------------------------
# a whole step: d1's phases against dllm_fast's trainer phases


def step_rows(run: Run) -> list[dict]:
    setting = f"diffu_grpo step, G={STEP_GROUP}, mu={run.shapes['inner_updates']}"
    providers = ["dllm_fast", "dllm_fast dual cache", "d1 phases (sum)"]
    reason = peer_code.missing(run.peers, "d1") or peer_code.missing(run.peers, "fast_dllm")
    if reason:
        return skipped("step", setting, providers, reason)
    from dllm_fast import objectives
    from dllm_fast.contracts import RolloutBatch, completion_mask
    from dllm_fast.rollout.config import GenerateConfig
    from dllm_fast.train.step import moved_after_first, roll_out

    s = run.shapes
    mu = s["inner_updates"]
    model = llada_model(run)
    ref = reference_model(run)
    twins = {name: peer_models.official_llada(run.peers, m) for name, m in (("policy", model), ("ref", ref))}
    mask_id, eos = model.mask_token_id, model.eos_token_id
    prompt = llada_prompts(run, model)[:1].expand(STEP_GROUP, -1).contiguous()  # one prompt, G completions
    P = prompt.shape[1]
    objective = objectives.get("diffu_grpo")
    micro_batch = s["micro_batch"]

    def reward(sequences):  # synthetic and deterministic: a hash of the completion, differing within the group
        return (sequences[:, P:].sum(-1) % 7).to(torch.float32)

    block, per_block = s["block"], s["steps"] // (s["gen"] // s["block"])

    def ours(cache: str, blocks: int):
        config = GenerateConfig(gen_length=blocks * block, block_length=block, steps=per_block * blocks,
                                temperature=D1_TEMPERATURE, cache=cache)
        generator = torch.Generator(run.device).manual_seed(0)
        result = roll_out(model, prompt, None, config, generator=generator, record_unmask_step=False)
        batch = RolloutBatch.from_generation(result, reward(result.sequences), group_size=STEP_GROUP)
        updates = objective.plan_updates(model, batch, moved=moved_after_first(mu), micro_batch=micro_batch,
                                         generator=torch.Generator().manual_seed(1))
        for update in updates:
            model.zero_grad(set_to_none=True)
            objective.backward(model, batch, update, micro_batch=micro_batch, ref_model=ref)

    trainer = official_trainer(run, "diffu_grpo", mu, 0, mask_id)
    trainer.args.fp16 = False
    policy, reference = peer_models.Quiet(twins["policy"]), peer_models.Quiet(twins["ref"])

    def theirs(blocks: int):
        with official_losses(run):
            official_step(blocks)

    def official_step(blocks: int):
        sequences = trainer.generate(policy, prompt, steps=per_block * blocks, gen_length=blocks * block,
                                     block_length=block, temperature=D1_TEMPERATURE, cfg_scale=0.0,
                                     remasking="low_confidence", mask_id=mask_id)
        completion = sequences[:, P:]
        L = completion.shape[1]
        batch = RolloutBatch(sequences, None, P, completion_mask(completion, eos), reward(sequences), STEP_GROUP)
        inputs = dict(prompt_ids=sequences[:, :P], prompt_mask=torch.ones_like(sequences[:, :P]),
                      completion_ids=completion, completion_mask=batch.completion_mask.int(),
                      advantages=objective.advantages(batch).to(torch.float32),
                      mask_seeds=[1234 + k for k in range(mu)])
        expanded = sequences.unsqueeze(0).expand(mu, -1, -1)
        with torch.no_grad():
            inputs["old_per_token_logps"] = trainer._get_per_token_logps(policy, expanded, L, inputs["mask_seeds"])
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps(reference, expanded, L,
                                                                         inputs["mask_seeds"])
        for k in range(mu):
            trainer._step = k
            model.zero_grad(set_to_none=True)
            trainer.compute_loss(policy, inputs).backward()

    runs = {"dllm_fast": functools.partial(ours, "none"), "dllm_fast dual cache": functools.partial(ours, "dual"),
            "d1 phases (sum)": theirs}
    for call in runs.values():  # warm-up: a step of one block
        call(1)
    blocks = s["gen"] // block
    seconds = timed({name: functools.partial(call, blocks) for name, call in runs.items()}, run)
    model.zero_grad(set_to_none=True)
    rows = [row("step", setting, name, seconds=seconds[name], s_per_prompt=seconds[name], agree=None)
            for name in runs]
    return with_ratio(rows)


# ---------------------------------------------------------------------------------------------------------
# the LM head


def head_rows(run: Run) -> list[dict]:
    import dllm_fast

    peer_code.use_wheels(run.peers)
    s = run.shapes
    M, d, V = s["head_rows"], s["head_d"], s["head_vocab"]
    setting = f"head M={M} d={d} V={V}"
    generator = torch.Generator(run.device).manual_seed(run.seed)
    hidden = torch.randn(M, d, device=run.device, generator=generator).to(run.dtype)
    weight = (torch.randn(V, d, device=run.device, generator=generator) * (2.0 / d ** 0.5)).to(run.dtype)
    targets = torch.randint(0, V, (M,), device=run.device, generator=generator)
    upstream = torch.randn(M, device=run.device, generator=generator)

    def gradient_of(logprobs):
        def call():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            lp = logprobs(h, w)
            lp.backward(upstream.to(lp.dtype))
            return lp.detach().double(), h.grad.double()
        return call

    providers = {
        "dllm_fast": gradient_of(lambda h, w: dllm_fast.masked_logprobs(h, w, targets)),
        "naive": gradient_of(lambda h, w: torch.log_softmax((h @ w.T).float(), -1).gather(1, targets[:, None])[:, 0]),
    }
    rows, reasons = [], {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        if run.device.type != "cuda":
            raise RuntimeError("Liger's fused linear cross-entropy is Triton kernels, which need a CUDA GPU; the "
                               "package has no torch fallback")
        providers["liger fused linear CE"] = gradient_of(
            lambda h, w: -liger_fused_linear_cross_entropy(h, w, targets, reduction="none"))
    except Exception as error:  # noqa: BLE001 - any import or platform failure is the row's reason
        reasons["liger fused linear CE"] = f"{type(error).__name__}: {error}"
    try:
        from cut_cross_entropy import linear_cross_entropy
        if run.device.type != "cuda":
            raise RuntimeError("Cut Cross-Entropy's kernels are Triton, which needs a CUDA GPU")
        providers["cut cross-entropy"] = gradient_of(
            lambda h, w: -linear_cross_entropy(h, w, targets, reduction="none", impl="cce"))
    except Exception as error:  # noqa: BLE001
        reasons["cut cross-entropy"] = (f"{type(error).__name__}: {error} (its documented torch fallback, "
                                        "impl='torch_compile', is imported behind the Triton module)")
    results = {name: call() for name, call in providers.items()}  # warm-up, and the values compared
    seconds = timed(providers, run)
    base_lp, base_grad = results["naive"]
    for name in providers:
        lp, grad = results[name]
        rel = float((grad - base_grad).norm() / base_grad.norm())
        lp_err = float((lp - base_lp).abs().max())
        rows.append(row("head", setting, name, seconds=seconds[name], ms=1e3 * seconds[name],
                        agree=lp_err <= HEAD_TOLERANCE[run.float64] and rel <= HEAD_TOLERANCE[run.float64],
                        lp_max_err=lp_err, grad_rel=rel))
    for name, reason in reasons.items():
        rows.append(row("head", setting, name, f"skipped: {reason}"))
    for name, low, high in PUBLISHED_HEAD:
        rows.append(row("head", "head H200 bf16 M=8192 d=4096 V=128256", name,
                        "published H200 figure, not measured: the kernels exceed what a GPU run carries",
                        ms_published=f"{1e3 * low:.0f}-{1e3 * high:.0f}"))
    return with_ratio(rows)


# ---------------------------------------------------------------------------------------------------------
# planner estimates


def plan_rows(gpu: str, peers_dir: Path, kinds) -> list[dict]:
    """PLANNER ESTIMATES of the 8b preset's rows (benchmarks/plan_peers.py)."""
    return plan_peers.estimates(gpu, peers_dir, kinds)


# ---------------------------------------------------------------------------------------------------------
# the command


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, default=None,
                        help=f"the peers folder (default: ${ENV_PEERS}, else .gpu/peers/)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float64", "float32", "bfloat16"],
                        help="model dtype (default: float64 on CPU, so that agreement is exact; bfloat16 on CUDA)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds after the warm-up")
    parser.add_argument("--threads", type=int, help="torch threads (default: 1 on CPU, where the small shapes gain "
                                                    "nothing from more and a shared machine's load stalls them)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    parser.add_argument("--plan", action="store_true", help="print the planner's estimates of the 8b rows instead")
    parser.add_argument("--gpu", default="h200", help="the GPU the estimates are for (with --plan)")
    parser.add_argument("--results-dir", type=Path, help="also write the rows there as peers_<preset>_<device>.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1 timed round")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: give at least 1")
    if args.device == "cuda" and not args.plan and not torch.cuda.is_available():
        parser.error("--device cuda: this torch has no usable CUDA device; use --device cpu")
    if args.peers is None:
        args.peers = Path(os.environ.get(ENV_PEERS) or peer_code.default_peers_dir())
    if not args.plan and not args.peers.is_dir():
        parser.error(f"--peers {args.peers}: no such folder (it holds one checkout per repository, named "
                     "<owner>+<name>; benchmarks/pack_peers.sh makes one)")
    if args.dtype is None:
        args.dtype = "float64" if args.device == "cpu" else "bfloat16"
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    return args


def run_kinds(run: Run, kinds, report: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every row of `kinds`; `report(rows so far)` after each kind (a run cut short keeps what it measured)."""
    builders = {"rollout": rollout_rows, "update": update_rows,
                "step": lambda run: guarded("step", "diffu_grpo step", ["dllm_fast"],
                                            functools.partial(step_rows, run)),
                "head": lambda run: guarded("head", "head", ["dllm_fast"], functools.partial(head_rows, run))}
    rows = []
    for kind in kinds:
        started = time.perf_counter()
        rows += builders[kind](run)
        if kind == "rollout":  # the SDAR model is used by rollouts only: its memory goes back
            sdar_model.cache_clear()
            gc.collect()
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[{kind}: {time.perf_counter() - started:.1f} s]", file=sys.stderr, flush=True)
        report(rows)
    return rows


def main(argv=None) -> list[dict]:
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = "peers_plan_" + args.gpu if args.plan else f"peers_{args.preset}_{args.device}"
    config = {k: str(v) for k, v in vars(args).items() if k != "results_dir"}

    def report(rows):
        if args.results_dir:
            write_results(name, config, rows, args.results_dir)

    if args.plan:
        rows = plan_rows(args.gpu, args.peers, args.kinds)
        report(rows)
    else:
        run = Run(args.peers.resolve(), args.preset, torch.device(args.device), getattr(torch, args.dtype),
                  args.repeats)
        rows = run_kinds(run, args.kinds, report)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    else:
        print_rows(rows)
    return rows


if __name__ == "__main__":
    main()
