"""verl's batch (a TensorDict of padded rows) as dllm_fast's RolloutBatch and masks, and back (no verl import: the
TensorDict is read through its mapping interface).

What the engine reads from verl's batch (the keys verl's PPO trainer gives every actor call):
- `prompts` [B, P] (left-padded), `responses` [B, R] (right-padded), `attention_mask` [B, P + R];
- `uid` (one per prompt: the rows of a prompt's group share it);
- at the update: `token_level_rewards` [B, R] (a row's reward is its sum) and `advantages` [B, R];
- for trajectory objectives (TraceRL): `dllm_fast_unmask_step` [B, R] int64, the denoising forward at which the
  rollout unmasked each response position (`generate(..., record_unmask_step=True)`), which dllm_fast's verl
  rollout puts in the batch, and optionally `dllm_fast_rollout_forwards` [B] int64 (the rollout's forward count,
  `GenerationResult.nfe`, which bounds the steps; default: R).

A response is read as the rollout's canvas: positions past its attended length hold EOS (as dllm_fast's sampler
leaves them), and every response position is attended, as in sampling. Rows are regrouped so that each prompt's
group is contiguous (`VerlRows.order` maps them back).

Masks: each row's masks are drawn from its own generator, seeded from the engine's seed and the row's identity (its
uid and tokens, `row_keys`), so the old-policy scoring, the update, every rank and every micro-batch split draw
the same masks for a row without passing them around. A sampler that draws nothing (trajectory) replays the
rollout for the whole batch at once.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import torch

from dllm_fast.contracts import RolloutBatch, block_length, completion_mask
from dllm_fast.integrations.verl.losses import sequence_advantages
from dllm_fast.likelihood import MonteCarloMasks
from dllm_fast.likelihood.samplers import SAMPLERS
from dllm_fast.objectives import Objective

UNMASK_STEP_KEY = "dllm_fast_unmask_step"
FORWARDS_KEY = "dllm_fast_rollout_forwards"
GROUPING_SETTINGS = ("trainer.balance_batch=false, actor_rollout_ref.actor.shuffle=false, and "
                     "actor_rollout_ref.actor.ppo_mini_batch_size (prompts) a multiple of the data-parallel size")


@dataclass
class VerlRows:
    """verl rows as a RolloutBatch. order[k]: the verl row of batch row k; keys[k]: its identity (mask seeds and
    the old policy's store); prompt_lengths / response_lengths [B]: attended positions of each verl row."""

    batch: RolloutBatch
    order: list[int]
    uids: list[str]
    keys: list[bytes]
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor

    @property
    def groups(self) -> Counter:
        return Counter(self.uids)


def _field(data, key: str, what: str):
    if key not in data.keys():
        raise KeyError(f"verl's batch has no {key!r} ({what}); the dllm_fast engine reads the batch verl's PPO trainer "
                       "hands its actor.")
    return data[key]


def uid_list(data) -> list[str]:
    return [str(u) for u in _field(data, "uid", "each row's prompt id, which groups the completions of one prompt")]


def rows_from_verl(data, *, eos_token_id: int, device: torch.device, grouped: bool,
                   group_sizes: Counter | None = None, unmask_step: bool = False) -> VerlRows:
    """The rows of verl's batch as a RolloutBatch on `device`.

    grouped: the rows must hold whole prompt groups of one size G (the update: advantages are per group), each
    uid's count equal to `group_sizes[uid]` (the whole batch's, counted when the old policy was scored) when
    given; rewards are the rows' summed `token_level_rewards`. Not grouped (scoring): group_size 1 and zero
    rewards, which scoring does not read. unmask_step: read `dllm_fast_unmask_step` (trajectory objectives)."""
    prompts = _field(data, "prompts", "the left-padded prompt ids")
    responses = _field(data, "responses", "the right-padded response ids")
    attention = _field(data, "attention_mask", "which prompt and response positions are tokens")
    for name, value in (("prompts", prompts), ("responses", responses), ("attention_mask", attention)):
        if not isinstance(value, torch.Tensor) or value.is_nested or value.dim() != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ""
            raise TypeError(f"verl's batch field {name!r} must be a padded [batch, length] tensor, got "
                            f"{type(value).__name__}{shape}.")
    B, P = prompts.shape
    R = responses.shape[1]
    if tuple(attention.shape) != (B, P + R):
        raise ValueError(f"verl's attention_mask has shape {tuple(attention.shape)}, expected (batch, prompt + "
                         f"response) = {(B, P + R)}.")
    uids = uid_list(data)
    if len(uids) != B:
        raise ValueError(f"verl's batch has {len(uids)} uids for {B} rows.")
    order = _grouped_order(uids) if grouped else list(range(B))
    index = torch.tensor(order, dtype=torch.long)
    attention = attention.to(device)[index].long()
    prompt_real = attention[:, :P]
    response_real = attention[:, P:].bool()
    completion = responses.to(device)[index].long().masked_fill(~response_real, eos_token_id)
    sequences = torch.cat([prompts.to(device)[index].long(), completion], dim=1)
    full_attention = torch.cat([prompt_real, torch.ones_like(completion)], dim=1)
    steps = forwards = None
    if unmask_step:
        steps = _field(data, UNMASK_STEP_KEY, "the rollout's decoding order, which dllm_fast's verl rollout records")
        if not isinstance(steps, torch.Tensor) or tuple(steps.shape) != (B, R):
            raise ValueError(f"verl's batch field {UNMASK_STEP_KEY!r} must be a [batch, response_length] = {(B, R)} "
                             f"int64 tensor, got {getattr(steps, 'shape', type(steps).__name__)}.")
        steps = steps.to(device)[index].long()
        if FORWARDS_KEY in data.keys():
            forwards = int(data[FORWARDS_KEY].max())
    group_size = 1
    rewards = torch.zeros(B, dtype=torch.float32, device=device)
    uids = [uids[i] for i in order]
    if grouped:
        group_size = _group_size(uids, group_sizes)
        token_rewards = _field(data, "token_level_rewards", "the rewards")
        rewards = token_rewards.to(device)[index].float().sum(-1)
    batch = RolloutBatch(sequences=sequences, attention_mask=None if bool(prompt_real.all()) else full_attention,
                         prompt_length=P, completion_mask=completion_mask(completion, eos_token_id), rewards=rewards,
                         group_size=group_size, unmask_step=steps, forwards=forwards)
    return VerlRows(batch=batch, order=order, uids=uids, keys=row_keys(batch, uids),
                    prompt_lengths=prompt_real.sum(-1).cpu(), response_lengths=response_real.sum(-1).cpu())


def _grouped_order(uids: list[str]) -> list[int]:
    """Row indices with each uid's rows together, the uids in order of first appearance (stable)."""
    rows: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        rows.setdefault(uid, []).append(i)
    return [i for group in rows.values() for i in group]


def _group_size(uids: list[str], group_sizes: Counter | None) -> int:
    counts = Counter(uids)
    if group_sizes is not None:
        for uid, count in counts.items():
            whole = group_sizes.get(uid)
            if whole is not None and whole != count:
                raise ValueError(f"this mini-batch holds {count} of prompt {uid!r}'s {whole} completions: the "
                                 "objective's advantages (and wd1's softmax) are computed per prompt group, so each "
                                 f"mini-batch on each rank must hold whole groups. Set {GROUPING_SETTINGS}.")
    sizes = set(counts.values())
    if len(sizes) != 1:
        uid, count = min(counts.items(), key=lambda kv: kv[1])
        raise ValueError(f"the prompt groups of this mini-batch differ in size (prompt {uid!r} has {count} "
                         f"completions, others {max(sizes)}); each mini-batch must hold whole groups of "
                         f"actor_rollout_ref.rollout.n completions. Set {GROUPING_SETTINGS}.")
    return sizes.pop()


def row_keys(batch: RolloutBatch, uids: list[str]) -> list[bytes]:
    """Each row's identity: a hash of its uid, its prompt's tokens (padding dropped) and its completion."""
    P = batch.prompt_length
    sequences = batch.sequences.cpu()
    real = (torch.ones_like(sequences, dtype=torch.bool) if batch.attention_mask is None
            else batch.attention_mask.cpu().bool())
    keys = []
    for uid, row, attended in zip(uids, sequences, real):
        digest = hashlib.blake2b(str(uid).encode(), digest_size=16)
        digest.update(row[:P][attended[:P]].numpy().tobytes())
        digest.update(b"|")
        digest.update(row[P:].numpy().tobytes())
        keys.append(digest.digest())
    return keys


def row_seed(seed: int, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, key=str(seed).encode()).digest(), "little") >> 1


def row_masks(objective: Objective, batch: RolloutBatch, keys: list[bytes], *, seed: int, model) -> MonteCarloMasks:
    """The objective's masks for the batch's rows: each row's from its own generator (`row_seed(seed, key)`, keys
    from `row_keys`), on the batch's device; a sampler that draws nothing replays the whole batch at once."""
    eos = getattr(model, "eos_token_id", None)
    blocks = block_length(model)
    if not SAMPLERS[objective.config.sampler].random:
        return objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=eos, model_block_length=blocks)
    parts = []
    for n, key in enumerate(keys):
        row = _one_row(batch, n)
        generator = torch.Generator().manual_seed(row_seed(seed, key))
        parts.append(objective.draw_masks(row, generator=generator, eos_token_id=eos, model_block_length=blocks))
    return cat_masks(parts)


def _one_row(batch: RolloutBatch, n: int) -> RolloutBatch:
    part = slice(n, n + 1)
    return RolloutBatch(sequences=batch.sequences[part],
                        attention_mask=None if batch.attention_mask is None else batch.attention_mask[part],
                        prompt_length=batch.prompt_length, completion_mask=batch.completion_mask[part],
                        rewards=batch.rewards[part], group_size=1,
                        unmask_step=None if batch.unmask_step is None else batch.unmask_step[part],
                        forwards=batch.forwards)


def cat_masks(parts: list[MonteCarloMasks]) -> MonteCarloMasks:
    """The masks of consecutive sequences drawn separately, as one MonteCarloMasks (same sampler and n_t)."""
    first = parts[0]

    def cat(name):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return MonteCarloMasks(masked=cat("masked"), counted=cat("counted"), weight=cat("weight"), t=cat("t"),
                           num_masked=cat("num_masked"), prompt_length=first.prompt_length, sampler=first.sampler,
                           fingerprint=cat("fingerprint"), target=cat("target"))


def per_token(lp: torch.Tensor, masks: MonteCarloMasks) -> torch.Tensor:
    """[N, n_t, L] -> [N, L]: each completion token's share of the ELBO estimate, (1/n_t) sum_j w_j lp[n, j, i] on
    the positions the estimate reads (its sum over i is `likelihood.elbo`)."""
    weight = masks.weight.to(lp.dtype)
    weighted = (weight[..., None] if weight.dim() == 2 else weight) * torch.where(masks.targets, lp, 0.0)
    return weighted.sum(1) / masks.n_t


def verl_token_values(values: torch.Tensor, rows: VerlRows) -> torch.Tensor:
    """[N, L] per-token values of the batch rows -> verl's nested layout of per-token outputs: verl row r holds its
    prompt_len + response_len attended positions, response token i's value at position prompt_len - 1 + i (a causal
    LM's output at i - 1 predicts token i; verl's no_padding_2_padding reads it back there)."""
    by_verl_row = [None] * len(rows.order)
    for k, r in enumerate(rows.order):
        p, q = int(rows.prompt_lengths[k]), int(rows.response_lengths[k])
        row = values.new_zeros(p + q)
        row[p - 1:p - 1 + q] = values[k, :q]
        by_verl_row[r] = row
    return torch.nested.as_nested_tensor(by_verl_row, layout=torch.jagged)


def verl_advantages(data, rows: VerlRows) -> torch.Tensor:
    """[N] float64: verl's advantage of each batch row (one value per sequence, checked), in batch order."""
    advantages = _field(data, "advantages", "verl's advantages")
    mask = _field(data, "response_mask", "which response positions are scored")
    index = torch.tensor(rows.order, dtype=torch.long)
    return sequence_advantages(advantages[index].double(), mask[index].bool())
