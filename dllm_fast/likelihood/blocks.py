"""What a masked position is scored given, for bidirectional and for block-diffusion models: the hidden states
that predict the masked tokens of a noisy sequence.

A bidirectional model (LLaDA, Dream) reads the whole noisy sequence: one forward on it. A block-diffusion model
(SDAR, TraDo; contracts.block_length) scores a masked token given the clean tokens of the earlier blocks and the
partly masked tokens of its own block, so `lp[N, n_t, L]` keeps its meaning (log p of each masked completion
token) under the block-diffusion likelihood: the sum over blocks of each block's conditional given the blocks
before it. All blocks of a (sequence, sample) pair are scored in one forward, in the two-stream layout block
diffusion trains with (SDAR's training code, TraceRL's for SDAR/TraDo): [clean | noisy], where the clean stream is
the sequence (the prompt as the mask leaves it, the completion clean) and the noisy stream is the masked copy of
the columns from `noisy_start` on, and the attention lets each noisy block read the clean earlier blocks and
itself (models/block_attention.py).

Exact: a noisy block's output is what a forward on [the columns before its block, clean; the block, noisy],
truncated after the block, gives (the per-block scoring of reference/sdar.py, which the tests compare with).
Its cost is one forward of S + (S - noisy_start) <= 2S - P + b tokens per pair instead of S (at most twice the
bidirectional forward's tokens; attention with a dense [T, T] mask), against one forward per block per pair for
the per-block scheme. The prompt's columns before the first block that holds a completion position are in
the clean stream only, since nothing there is scored.

What each sampler, and so each objective, estimates on a block model (all ten objectives run on one):

- random_t (BGPO, VRPO-OL), stratified_l (RSPO), complementary (ESPO): unbiased for the block ELBO, the sum over
  blocks of each block's ELBO given the clean blocks before it (a noise level shared by a sample's blocks is,
  restricted to one block, that block's noise level); block_elbo: the same with a noise level per block.
- gauss (GDPO) and coupled (Coupled-GRPO): the same integral by quadrature, DiffuCoder's per-token average.
- trajectory (TraceRL): the block rollout's own states, each inside one block (with shrink 1, the official
  SDAR/TraDo setting; preset "sdar") given the clean earlier blocks: what the rollout conditioned on.
- mean_field (diffu-GRPO, wd1): every block fully masked given the clean earlier blocks, a one-step estimate per
  block (what a block's first denoising step computes).
- block (SPG): its masks as drawn (a partly masked block, the later blocks fully masked, the earlier ones and the
  prompt perturbed), each block scored given the clean blocks before it; its weights L_n / m then mix the
  blocks' noise levels, so it stays SPG's own heuristic, designed for bidirectional models decoded in blocks.
"""

from __future__ import annotations

import torch

from dllm_fast.contracts import block_length as block_length_of


def noisy_start(prompt_length: int, block_length: int) -> int:
    """The first column of the noisy stream: every block that holds a completion position starts at or after it
    in every row (blocks align to each row's first real token; a completion block reaches at most
    block_length - 1 columns into the prompt), and one column more, so that a logit_shift=1 model's first
    prediction (from column P - 1) is in the noisy stream too."""
    return max(0, prompt_length - block_length)


def denoising_hidden(model, tokens: torch.Tensor, noisy: torch.Tensor, attention_mask: torch.Tensor | None,
                     prompt_length: int) -> torch.Tensor:
    """[b, S, d]: column j's hidden state as the model's likelihood conditions it, for the masked tokens of
    `noisy` [b, S] (the clean `tokens` [b, S] with some positions replaced by the mask token). For a block model,
    only the columns from `noisy_start` on are meaningful (the rest are never scored)."""
    block = block_length_of(model)
    if block is None:
        return model(noisy, attention_mask=attention_mask)
    S = tokens.shape[1]
    start = noisy_start(prompt_length, block)
    context = torch.cat([noisy[:, :prompt_length], tokens[:, prompt_length:]], dim=1)
    hidden = model(torch.cat([context, noisy[:, start:]], dim=1), attention_mask=attention_mask, clean_length=S)
    return hidden[:, S - start:]  # column j >= start sits at S + (j - start)
