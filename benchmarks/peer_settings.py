"""What the comparison with the peers' official code runs, shared by bench_peers.py (the measurements) and
plan_peers.py (the planner's estimates of them): the kinds of rows, each preset's shapes, the official settings,
where each official loss's code is, and how a row prints. Both import it; it imports neither."""

from __future__ import annotations

KINDS = ("rollout", "update", "step", "head")

# Shapes per preset. small: narrow LLaDA and SDAR models with a 2,048-token vocabulary (the peers take the mask
# id as an argument), float64 on CPU so that agreement is exact, in about a minute; 8b: LLaDA-8B and SDAR-8B, bf16
# on a GPU.
PRESETS = {
    "small": dict(llada="peers-small", sdar="peers-small", batch=2, prompt=16, gen=32, block=8, steps=16,
                  sdar_prompt=16, sdar_gen=16, sdar_block=4, sequences=4, group=4, update_prompt=16, completion=64,
                  inner_updates=2, old="perturbed", micro_batch=8, head_rows=256, head_d=128, head_vocab=8192),
    "8b": dict(llada="llada-8b", sdar="sdar-8b", batch=2, prompt=200, gen=256, block=32, steps=128,
               sdar_prompt=200, sdar_gen=256, sdar_block=4, sequences=2, group=2, update_prompt=200, completion=256,
               inner_updates=2, old="policy", micro_batch=8, head_rows=8192, head_d=4096, head_vocab=126464),
}
STEP_GROUP = 4  # completions per prompt in the whole step (d1's recipe has 6)
THRESHOLD = 0.9
SDAR_THRESHOLD = 0.85  # block_diffusion_generate's default confidence_threshold
D1_TEMPERATURE = 0.9  # d1's train.yaml

# The official code per objective: (peer, file, class, methods, module-level functions the methods call).
OFFICIAL_LOSSES = {
    "diffu_grpo": ("d1", "diffu-grpo/diffu_grpo_trainer.py", "DiffuGRPOTrainer",
                   ("compute_loss", "_get_per_token_logps", "forward_process", "get_logits", "generate",
                    "add_gumbel_noise", "get_num_transfer_tokens"), ()),
    "spg": ("spg", "spg/spg_trainer.py", "SPGTrainer",
            ("compute_loss", "_get_per_seq_logps", "forward_process", "get_logits"), ()),
    "espo": ("espo", "espo/espo_trainer.py", "ESPOTrainer",
             ("compute_loss", "_get_elbo_mc", "_get_elbo", "get_logits", "_get_elbo_by_chunk"),
             ("forward_process", "compute_approx_kl")),
}
# dllm_fast's options that reproduce each official code (README's objectives table), and the code's settings
# (the official recipes: d1 train.yaml; SPG's mix recipe; ESPO's GSM8K recipe).
DLLM_OPTIONS = {"diffu_grpo": {}, "spg": dict(normalization="token"), "espo": dict(advantage="leave_one_out")}


def print_rows(rows: list[dict]) -> None:
    columns = ["kind", "setting", "provider", "status", "seconds", "ratio", "agree"]
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in columns}
        values = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        seconds = f"{r['seconds']:.4g} s" if r.get("seconds") is not None else "-"
        ratio = f"x{r['ratio']:.3g}" if r.get("ratio") is not None else ""
        print(f"{r['kind']:8} {r['setting'][:44]:44} {r['provider'][:40]:40} {r['status'][:60]:8} {seconds:>10} "
              f"{ratio:>7} agree={r.get('agree')}  {values}")
