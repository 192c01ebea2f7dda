"""PLANNER ESTIMATES of bench_peers' GPU rows (its 8b preset), before they are measured: every number here is an
estimate of dllm_fast.planning (fake tensors, the calibration fitted on the first H200 run), never a measurement.

    python benchmarks/plan_peers.py --gpu h200 [--json]      # or: python benchmarks/bench_peers.py --plan

How each row is priced:

- dllm_fast's rows: the calls bench_peers makes, run by the planner as they are (`generate` at the setting,
  `Objective.backward` on one update's masks, the trainer's phases of a step via `plan_step`). Threshold
  decoding: the planner assumes every confidence below the threshold, so one token a step (its most steps).
- LLaDA's generate.py and Fast-dLLM's samplers: dllm_fast's reference sampler (dllm_fast.reference.generate,
  the plain-PyTorch port of both: the whole canvas each step without a cache, full logits over every fed position
  with the caches) at the same setting, Fast-dLLM's at batch 1 once per prompt as it runs; its host time scaled to
  the official model's kernels per forward (counted on the profiler's trace of a narrow model with the official
  layer count, `kernels_per_forward`), since the official model launches more kernels than dllm_fast's fused
  layers; plus Fast-dLLM's float64 softmax over every fed position's logits (its bytes at the calibrated
  bandwidth).
- SDAR's block_diffusion_generate: dllm_fast's block rollout at batch 1 per prompt, times the official loop's
  forwards over dllm_fast's (it stores each finished block with one more forward), its host time scaled to the
  Qwen3 stand-in's kernels per forward.
- The official losses (d1, SPG, ESPO): what their code computes, bench_objectives' full_logits provider (per Monte
  Carlo sample a forward of the noisy sequences with full [N, P + L, V] logits, log_softmax in fp32, every
  sample's graph kept, the objective's loss, one backward), on the same masks.
- d1's step: its phases in its order: the rollout as LLaDA's generate (d1's trainer runs that sampler), the old
  and reference log-probs (a no-grad full-logits forward of the mu x G rows each), mu official updates. The
  optimizer step is left out of both, as bench_peers leaves it out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import peer_code  # noqa: E402
import peer_models  # noqa: E402
import peer_settings  # noqa: E402

LABEL = "PLANNER ESTIMATE"
FLOAT64_SOFTMAX_BYTES = 2 + 8 + 8 + 8  # per logit: read bf16, write fp64, the softmax's read and write


def session(gpu: str, model: str, *, objective: str = "vrpo_ol", options: dict | None = None,
            launch_scale: float = 1.0, **settings):
    """A planning session of `model` in bf16 on `gpu`; launch_scale: each eager kernel stands for that many (code
    that launches more kernels than dllm_fast's for the same work: predict._launching)."""
    from dllm_fast.planning.calibration import DEFAULT
    from dllm_fast.planning.predict import _launching, target
    from dllm_fast.planning.step import Session
    from dllm_fast.train.config import TrainConfig

    config = TrainConfig(model=model, bf16=False, objective=objective, objective_options=options or {},
                         **settings)
    calibration = DEFAULT if launch_scale == 1.0 else _launching(DEFAULT, launch_scale)
    return Session(config, target=target(gpu, calibration), weights_dtype=torch.bfloat16, optimizer=False)


def estimate(kind: str, setting: str, provider: str, seconds: float, how: str, **values) -> dict:
    return dict(kind=kind, setting=setting, provider=provider, status=LABEL, seconds=seconds, how=how, **values)


# ---------------------------------------------------------------------------------------------------------
# kernels per forward: the official models against dllm_fast's


def _count(call) -> float:
    import bench_rollout

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with torch.profiler.record_function("peer.forward"):
            call()
    forward = [e for e in profile.events() if e.name == "peer.forward"]
    return sum(bench_rollout._launches(child, {}) for e in forward for child in e.cpu_children)


def kernels_per_forward(peers_dir: Path) -> dict[str, float | None]:
    """Kernels one eager forward launches (no grad, 64 tokens), on narrow models with the 8B layer counts: dllm_fast's
    LLaDA and SDAR, the official LLaDA model (Fast-dLLM's llada/model) and the Qwen3 stand-in of SDAR's. A peer
    without its checkout: None (its host time is then dllm_fast's)."""
    import bench_rollout
    from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel

    llada = LLaDAModel.with_random_weights(bench_rollout.narrow_config(LLaDAConfig.preset("llada-8b"))).eval()
    sdar_config = dataclasses.replace(SDARConfig.preset("sdar-8b"), hidden_size=128, intermediate_size=384,
                                      vocab_size=1024, mask_token_id=1023, eos_token_id=1022, pad_token_id=1022,
                                      eot_token_id=1021)
    sdar = SDARModel.with_random_weights(sdar_config).eval()
    ids = torch.randint(0, 1000, (1, 64))
    counts = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts["dllm_fast llada"] = _count(lambda: llada(ids))
        counts["dllm_fast sdar"] = _count(lambda: sdar(ids))
        counts["official llada"] = counts["qwen3 stand-in"] = None
        if peer_code.missing(peers_dir, "fast_dllm") is None:
            twin = peer_models.official_llada(peers_dir, llada, shared_gradients=False)
            counts["official llada"] = _count(lambda: twin(ids))
        stand_in = peer_models.qwen3_stand_in(sdar)
        counts["qwen3 stand-in"] = _count(lambda: stand_in(input_ids=ids))
    return counts


# ---------------------------------------------------------------------------------------------------------
# the rows


def official_sampler_work(model, batch: int, prompt: int, gen: int, block: int, steps: int, cache: str,
                          softmax_dtype: torch.dtype) -> None:
    """The tensor work of LLaDA's generate.py (cache "none") or Fast-dLLM's generate_with_prefix_cache /
    generate_with_dual_cache at T = 0, at fixed shapes (what the planner can run: no value is read), forward by
    forward: the model over the positions the official loop feeds (the whole canvas; at a block's first step the
    whole canvas into the cache, then the block and the rest (prefix) or the block (dual)), full logits of every
    fed position, argmax, the softmax of the logits in `softmax_dtype` (the model's dtype in LLaDA's, float64 in
    Fast-dLLM's), the chosen tokens' probabilities, the confidence masking and the per-row top-k. The canvas is not
    written back (the work does not depend on which tokens win)."""
    from dllm_fast.models.kv_cache import KVCache

    S = prompt + gen
    x = torch.zeros(batch, S, dtype=torch.long)
    weight = model.lm_head_weight
    kv = KVCache.for_model(model, batch, S) if cache != "none" else None
    blocks = gen // block
    for b in range(blocks):
        start, end = prompt + b * block, prompt + (b + 1) * block
        for step in range(steps // blocks):
            if cache == "none":
                fed, hidden = x, model(x)
            elif step == 0:  # the block's first step refreshes the cache over the whole canvas
                fed, hidden = x, model(x, cache=kv, cache_start=0, attend_length=S)
            else:
                fed = x[:, start:] if cache == "prefix" else x[:, start:end]
                hidden = model(fed, cache=kv, cache_start=start, attend_length=S)
            logits = hidden @ weight.T
            tokens = logits.argmax(dim=-1)
            confidence = torch.softmax(logits.to(softmax_dtype), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
            masked = fed == 0
            confidence = torch.where(masked, confidence, float("-inf"))
            tokens = torch.where(masked, tokens, fed)
            for row in range(batch):
                torch.topk(confidence[row], k=max(1, block // (steps // blocks)))


def official_sdar_work(model, batch: int, prompt: int, gen: int, block: int, steps_per_block: int) -> None:
    """The tensor work of SDAR's block_diffusion_generate (batch 1 as it runs), at fixed shapes: the prompt's whole
    blocks prefilled into the cache, then per block `steps_per_block` forwards of the block against the cache, each
    with its full logits, softmax and sampled token's probability, and one more forward that stores the finished
    block's keys and values."""
    from dllm_fast.models.kv_cache import KVCache

    S = prompt + gen
    x = torch.zeros(batch, S, dtype=torch.long)
    weight = model.lm_head_weight
    kv = KVCache.for_model(model, batch, S)
    model(x[:, :prompt], cache=kv, cache_start=0, attend_length=prompt)
    for start in range(prompt, S, block):
        end = start + block
        for _ in range(steps_per_block):
            logits = model(x[:, start:end], cache=kv, cache_start=start, attend_length=end) @ weight.T
            probs = torch.softmax(logits.float(), dim=-1)
            tokens = probs.argmax(dim=-1)
            probs.gather(-1, tokens[..., None])
        model(x[:, start:end], cache=kv, cache_start=start, attend_length=end)  # store_kv=True


def prompts(batch: int, length: int) -> torch.Tensor:
    """Prompt ids made inside a planning session (so they are its constants)."""
    return torch.randint(0, 100000, (batch, length), generator=torch.Generator().manual_seed(1))


def planned_seconds(gpu: str, model: str, work, *, launch_scale: float = 1.0, **settings) -> tuple[float, int]:
    """(seconds, nfe or 0) of `work(policy)` in a planning session of `model` (see `session`)."""
    s = session(gpu, model, launch_scale=launch_scale, **settings)
    with s, torch.no_grad():
        phase, result = s.measure("rollout", lambda: work(s.policy))
    return phase.costs.seconds, int(getattr(result, "nfe", 0) or 0)


def rollout_estimates(gpu: str, shapes: dict, scale: dict[str, float]) -> list[dict]:
    import dllm_fast

    rows = []
    B, P, G, block, steps = shapes["batch"], shapes["prompt"], shapes["gen"], shapes["block"], shapes["steps"]
    settings = [("no cache", "none", steps, "llada generate.py"),
                ("prefix cache", "prefix", steps, "fast-dllm generate_with_prefix_cache"),
                ("dual cache", "dual", steps, "fast-dllm generate_with_dual_cache"),
                (f"dual cache, threshold {peer_settings.THRESHOLD}", "dual", G, "fast-dllm generate_with_dual_cache")]
    llada_scale = scale.get("llada", 1.0)
    for setting, cache, n_steps, provider in settings:
        config = dict(gen_length=G, block_length=block, diffusion_steps=n_steps, cache=cache)
        ours, _ = planned_seconds(gpu, "llada-8b", lambda m: dllm_fast.generate(
            m, prompts(B, P), gen_length=G, block_length=block, steps=n_steps, temperature=0.0, cache=cache,
            generator=torch.Generator().manual_seed(0)), **config)
        peer_batch, in_turn = (B, 1) if cache == "none" else (1, B)  # Fast-dLLM's generate: one prompt a call
        softmax_dtype = torch.bfloat16 if cache == "none" else torch.float64
        theirs, _ = planned_seconds(gpu, "llada-8b", lambda m: official_sampler_work(
            m, peer_batch, P, G, block, n_steps, cache, softmax_dtype), launch_scale=llada_scale, **config)
        theirs *= in_turn
        rows.append(estimate("rollout", setting, "dllm_fast", ours, "dllm_fast.generate on fake tensors" +
                             (", one token a step (confidences below the threshold)" if n_steps == G else ""),
                             tokens_per_s=B * G / ours))
        how = (f"the official loop's tensor work (official_sampler_work, cache {cache}, {n_steps} forwards) at batch "
               f"{peer_batch}" + (f", {in_turn} prompts in turn" if in_turn > 1 else "")
               + f"; host time x{llada_scale:.2f} (official kernels per forward)")
        rows.append(estimate("rollout", setting, provider, theirs, how, tokens_per_s=B * G / theirs))
    rows += sdar_estimates(gpu, shapes, scale)
    return rows


def sdar_estimates(gpu: str, shapes: dict, scale: dict[str, float]) -> list[dict]:
    import dllm_fast

    rows = []
    B, P, G, block = shapes["batch"], shapes["sdar_prompt"], shapes["sdar_gen"], shapes["sdar_block"]
    for setting, steps in (("sdar greedy (one step a block)", G // block),
                           (f"sdar sampled T=1, threshold {peer_settings.SDAR_THRESHOLD}", G)):
        config = dict(gen_length=G, block_length=block, diffusion_steps=steps, cache="block")
        ours, _ = planned_seconds(gpu, "sdar-8b", lambda m: dllm_fast.generate(
            m, prompts(B, P), gen_length=G, block_length=block, steps=steps, temperature=0.0, cache="block",
            generator=torch.Generator().manual_seed(0)), **config)
        per_block = steps // (G // block)
        theirs, _ = planned_seconds(gpu, "sdar-8b", lambda m: official_sdar_work(m, 1, P, G, block, per_block),
                                    launch_scale=scale.get("sdar", 1.0), **config)
        theirs *= B
        rows.append(estimate("rollout", setting, "dllm_fast", ours, "dllm_fast.generate(cache='block') on fake "
                             "tensors, one token a step below the threshold", tokens_per_s=B * G / ours))
        rows.append(estimate("rollout", setting, "sdar block_diffusion_generate", theirs,
                             f"the official loop's tensor work (official_sdar_work: {per_block} forwards a block "
                             f"and one that stores it) at batch 1, {B} prompts in turn; host time "
                             f"x{scale.get('sdar', 1.0):.2f} (the Qwen3 stand-in's kernels per forward)",
                             tokens_per_s=B * G / theirs))
    return rows


def update_estimates(gpu: str, shapes: dict) -> list[dict]:
    import bench_objectives
    from dllm_fast import objectives
    from dllm_fast.contracts import RolloutBatch, completion_mask
    from dllm_fast.likelihood import score
    from dllm_fast.objectives import InnerUpdate

    rows = []
    N, P, L, mb = shapes["sequences"], shapes["update_prompt"], shapes["completion"], shapes["micro_batch"]
    for name, (peer, *_rest) in peer_settings.OFFICIAL_LOSSES.items():
        setting, options = f"{name} ({peer})", peer_settings.DLLM_OPTIONS[name]
        costs, peaks = {}, {}
        for provider in ("dllm_fast", "official"):
            s = session(gpu, "llada-8b", objective=name, options=options, micro_batch=mb)
            with s:
                model, objective = s.policy, objectives.get(name, **options)
                generator = torch.Generator().manual_seed(3)
                sequences = torch.randint(0, model.eos_token_id, (N, P + L), generator=generator)
                sequences[0, P + L // 2:] = model.eos_token_id
                rewards = (torch.arange(N) % 2).to(torch.float32)
                batch = RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], model.eos_token_id),
                                     rewards, shapes["group"])
                masks = objective.draw_masks(batch, generator=generator, eos_token_id=model.eos_token_id)
                with torch.no_grad():
                    lp_old = score(model, sequences, masks, micro_batch=mb) if objective.uses_old_policy else None
                    lp_ref = score(model, sequences, masks, micro_batch=mb) if objective.needs_reference else None
                if provider == "dllm_fast":
                    call = lambda: objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), lp_ref=lp_ref,
                                                      micro_batch=mb)
                else:
                    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
                    call = lambda: objective.loss(bench_objectives.full_logits_lp(model, sequences, masks, None),
                                                  inputs).backward()
                phase, _ = s.measure("update", call)
                costs[provider] = phase.costs.seconds
                peaks[provider] = phase.peak / 2**30
        rows.append(estimate("update", setting, "dllm_fast", costs["dllm_fast"], "Objective.backward on fake "
                             "tensors (the trainer's later update: the engine's two passes)",
                             ms_per_update=1e3 * costs["dllm_fast"], peak_gib=peaks["dllm_fast"]))
        rows.append(estimate("update", setting, f"{peer} compute_loss", costs["official"],
                             "bench_objectives' full_logits (the official code's computation) on fake tensors",
                             ms_per_update=1e3 * costs["official"], peak_gib=peaks["official"]))
    return rows


def step_estimates(gpu: str, shapes: dict, rollout_rows: list[dict]) -> list[dict]:
    from dllm_fast.planning import plan_step
    from dllm_fast.train.config import TrainConfig

    mu, G, P, L = shapes["inner_updates"], peer_settings.STEP_GROUP, shapes["prompt"], shapes["gen"]
    setting = f"diffu_grpo step, G={G}, mu={mu}"
    rows = []
    for provider, cache in (("dllm_fast", "none"), ("dllm_fast dual cache", "dual")):
        config = TrainConfig(model="llada-8b", objective="diffu_grpo", prompts_per_step=1, group_size=G,
                             gen_length=L, block_length=shapes["block"], diffusion_steps=shapes["steps"], cache=cache,
                             temperature=peer_settings.D1_TEMPERATURE, inner_updates=mu,
                             micro_batch=shapes["micro_batch"], compile=False, bf16=False)
        plan = plan_step(config, gpu=gpu, prompt_length=P, weights_dtype="bfloat16", search=False)
        seconds = sum(p.costs.seconds for name, p in plan.phases.items() if p.runs and name != "optimizer step")
        rows.append(estimate("step", setting, provider, seconds, "plan_step's phases but the optimizer step",
                             s_per_prompt=seconds))
    rollout = _official_rollout(gpu, shapes, G)
    scoring, update = _official_scoring_and_update(gpu, shapes, G, mu)
    seconds = rollout + 2 * scoring + mu * update
    rows.append(estimate("step", setting, "d1 phases (sum)", seconds,
                         f"LLaDA's sampler at batch {G} ({rollout:.3g} s) + old and reference full-logits scoring of "
                         f"{mu} x {G} rows ({scoring:.3g} s each) + {mu} full-logits updates ({update:.3g} s each)",
                         s_per_prompt=seconds))
    return rows


def _official_rollout(gpu: str, shapes: dict, batch: int) -> float:
    """d1's trainer's generate: LLaDA's sampler (no cache; its Gumbel noise in the model's dtype at T > 0)."""
    seconds, _ = planned_seconds(gpu, "llada-8b", lambda m: official_sampler_work(
        m, batch, shapes["prompt"], shapes["gen"], shapes["block"], shapes["steps"], "none", torch.bfloat16),
        gen_length=shapes["gen"], block_length=shapes["block"], diffusion_steps=shapes["steps"], cache="none")
    return seconds


def _official_scoring_and_update(gpu: str, shapes: dict, G: int, mu: int) -> tuple[float, float]:
    import bench_objectives
    from dllm_fast import objectives
    from dllm_fast.contracts import RolloutBatch, completion_mask

    P, L = shapes["prompt"], shapes["gen"]
    s = session(gpu, "llada-8b", objective="diffu_grpo")
    with s:
        model, objective = s.policy, objectives.get("diffu_grpo")
        sequences = torch.randint(0, model.eos_token_id, (mu * G, P + L), generator=torch.Generator().manual_seed(3))
        batch = RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], model.eos_token_id),
                             (torch.arange(mu * G) % 2).to(torch.float32), G)
        masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(4), eos_token_id=model.eos_token_id)
        with torch.no_grad():
            scoring, _ = s.measure("scoring", lambda: bench_objectives.full_logits_lp(model, sequences, masks, None))
        few = RolloutBatch(sequences[:G], None, P, batch.completion_mask[:G], batch.rewards[:G], G)
        few_masks = masks.rows(0, G)
        inputs = objective.prepare(few, few_masks, lp_ref=torch.zeros(G, 1, L).masked_fill(few_masks.scored, -1.0),
                                   lp_old=torch.zeros(G, 1, L).masked_fill(few_masks.scored, -1.0))
        update, _ = s.measure("update", lambda: objective.loss(
            bench_objectives.full_logits_lp(model, few.sequences, few_masks, None), inputs).backward())
    return scoring.costs.seconds, update.costs.seconds


def head_estimates(gpu: str, shapes: dict) -> list[dict]:
    """The head's forward and backward at bench_peers' 8b point (predict.head: dllm_fast.masked_logprobs and plain
    PyTorch). Liger's and Cut Cross-Entropy's Triton kernels are not modelled by the planner: no estimate."""
    from dllm_fast.planning import predict

    M, setting = shapes["head_rows"], f"head M={shapes['head_rows']} d={shapes['head_d']} V={shapes['head_vocab']}"
    rows = [estimate("head", setting, provider, predict.head(gpu, M=M, provider=name, backward=True).seconds,
                     "predict.head on fake tensors") for provider, name in (("dllm_fast", "dllm_fast"),
                                                                             ("naive", "naive"))]
    for row in rows:
        row["ms"] = 1e3 * row["seconds"]
    return rows


def estimates(gpu: str, peers_dir: Path | None = None, kinds=("rollout", "update", "step", "head")) -> list[dict]:
    """Every 8b row of bench_peers, estimated for `gpu` (see the module docstring)."""
    shapes = peer_settings.PRESETS["8b"]
    peers_dir = Path(peers_dir or peer_code.default_peers_dir())
    rows = []
    if "rollout" in kinds:
        counts = kernels_per_forward(peers_dir)
        scale = {}
        if counts["official llada"]:
            scale["llada"] = counts["official llada"] / counts["dllm_fast llada"]
        scale["sdar"] = counts["qwen3 stand-in"] / counts["dllm_fast sdar"]
        rows += rollout_estimates(gpu, shapes, scale)
        rows.append(dict(kind="rollout", setting="kernels per forward (narrow 8B layouts)", provider="profiler",
                         status="counted on this CPU", **counts))
    if "update" in kinds:
        rows += update_estimates(gpu, shapes)
    if "step" in kinds:
        rows += step_estimates(gpu, shapes, rows)
    if "head" in kinds:
        rows += head_estimates(gpu, shapes)
    base = {(r["kind"], r["setting"]): r["seconds"] for r in rows if r["provider"] == "dllm_fast"}
    for r in rows:
        if r.get("seconds") is not None and (r["kind"], r["setting"]) in base:
            r["ratio"] = r["seconds"] / base[(r["kind"], r["setting"])]
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--peers", type=Path, default=None, help="the peers folder (for the official models' kernel "
                                                                 "counts; default: .gpu/peers/)")
    parser.add_argument("--kinds", nargs="+", choices=peer_settings.KINDS, default=list(peer_settings.KINDS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = estimates(args.gpu, args.peers, args.kinds)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    else:
        peer_settings.print_rows(rows)
    return rows


if __name__ == "__main__":
    main()
