"""verl's batch (a TensorDict of padded or nested rows) as dllm_fast's RolloutBatch and masks, and back (no verl
import: the TensorDict is read through its mapping interface).

What the engine reads from verl's batch, in either of its layouts (`padded_tokens`), as verl's own FSDP engine and
its `no_padding_2_padding` read them:
- the legacy PPO trainer's padded rows: `prompts` [B, P] (left-padded), `responses` [B, R] (right-padded),
  `attention_mask` [B, P + R];
- the V1 trainer's nested rows (each row its own length, no `attention_mask`): `prompts` and `responses`, every
  token of which is attended;
- `uid` (one per prompt: the rows of a prompt's group share it);
- at the update: `token_level_rewards` [B, R] (a row's reward is its sum; verl V1 gives `rm_scores` instead unless
  it applies a KL penalty in the reward) and `advantages` [B, R], padded or nested;
- for trajectory objectives (TraceRL): `dllm_fast_unmask_step` [R] int64 per row, the denoising forward at which
  the rollout unmasked each response position (`generate(..., record_unmask_step=True)`), and optionally
  `dllm_fast_rollout_forwards` (the rollout's forward count, `GenerationResult.nfe`, which bounds the steps;
  default: R), which dllm_fast's verl rollout puts in the batch (batch_keys.py: a key of the batch, or of each
  row's `extra_fields` under verl V1).

A response is read as the rollout's canvas: positions past its attended length hold EOS (as dllm_fast's sampler
leaves them), and every response position is attended, as in sampling. Rows are regrouped so that each prompt's
group is contiguous (`VerlRows.order` maps them back).

Masks: each row's masks are drawn from its own generator, seeded from the engine's seed and the row's identity (its
uid and tokens, `row_keys`), so the old-policy scoring, the update, every rank and every micro-batch split draw
the same masks for a row without passing them around. A sampler that draws nothing (trajectory) replays the
rollout for the whole batch at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from dataclasses import dataclass

import torch

from dllm_fast.contracts import RolloutBatch, block_length, completion_mask
from dllm_fast.integrations.verl.batch_keys import EXTRA_FIELDS_KEY, FORWARDS_KEY, UNMASK_STEP_KEY
from dllm_fast.integrations.verl.losses import sequence_advantages
from dllm_fast.likelihood import MonteCarloMasks
from dllm_fast.likelihood.masks import sequence_fingerprint
from dllm_fast.likelihood.samplers import SAMPLERS
from dllm_fast.objectives import Objective

GROUPING_SETTINGS = ("actor_rollout_ref.actor.shuffle=false and, with several data-parallel ranks, "
                     "actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size (verl's V1 trainer; the "
                     "legacy trainer: trainer.balance_batch=false)")


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


def _as_list(value) -> list:
    """A per-row field as a list: a tensor's rows, a NonTensorStack's or numpy array's items, a list itself."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind())
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _is_nested(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_nested


def _padded(value, fill) -> torch.Tensor:
    """A per-token field as a padded [batch, length] tensor: verl V1's nested rows right-padded with `fill`."""
    return torch.nested.to_padded_tensor(value, fill) if _is_nested(value) else value


def uid_list(data) -> list[str]:
    return [str(u) for u in _as_list(_field(data, "uid", "each row's prompt id, which groups the completions of one "
                                                          "prompt"))]


def _rows_of(value, name: str) -> list[torch.Tensor]:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) and not value.is_nested else ""
        raise TypeError(f"verl's batch field {name!r} must be a nested or [batch, length] tensor of token ids, got "
                        f"{type(value).__name__}{shape}.")
    return list(value.unbind())


def padded_tokens(data) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """prompts [B, P] (left-padded), which prompt positions are tokens [B, P], responses [B, R] (right-padded),
    which response positions are tokens [B, R], from either of verl's layouts, read as verl's own
    `no_padding_2_padding` reads them:
    - rows (the V1 trainer: each row holds its own tokens, no attention_mask): the lengths are the rows', a nested
      tensor's or, where every row of a field has one length (verl then stacks them), the full width;
    - padded (the legacy PPO trainer): `attention_mask` [B, P + R] says which positions are tokens."""
    prompts = _field(data, "prompts", "the prompt ids")
    responses = _field(data, "responses", "the response ids")
    if _is_nested(prompts) or _is_nested(responses) or "attention_mask" not in data.keys():
        prompt_rows, response_rows = _rows_of(prompts, "prompts"), _rows_of(responses, "responses")
        if len(prompt_rows) != len(response_rows):
            raise ValueError(f"verl's batch has {len(prompt_rows)} prompts for {len(response_rows)} responses.")
        prompt_lengths = torch.tensor([len(row) for row in prompt_rows])
        response_lengths = torch.tensor([len(row) for row in response_rows])
        if bool((prompt_lengths == 0).any()):
            raise ValueError(f"verl's batch has an empty prompt (row {int((prompt_lengths == 0).nonzero()[0])}); "
                             "every prompt needs at least one token.")
        P, R = int(prompt_lengths.max()), int(response_lengths.max())
        prompt_real = torch.arange(P) >= P - prompt_lengths[:, None]  # left-padded, as dllm_fast's rollouts
        response_real = torch.arange(R) < response_lengths[:, None]
        padded_prompts = torch.zeros(len(prompt_rows), P, dtype=torch.long, device=prompts.device)
        padded_responses = torch.zeros(len(response_rows), R, dtype=torch.long, device=responses.device)
        for n, (prompt, response) in enumerate(zip(prompt_rows, response_rows)):
            padded_prompts[n, P - len(prompt):] = prompt
            padded_responses[n, :len(response)] = response
        return padded_prompts, prompt_real, padded_responses, response_real
    attention = _field(data, "attention_mask", "which prompt and response positions are tokens, in verl's padded "
                                               "layout (its nested V1 rows need none)")
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
    return prompts, attention[:, :P].bool(), responses, attention[:, P:].bool()


def rollout_field(data, key: str, what: str) -> list | None:
    """A field dllm_fast's rollout adds (batch_keys.py) as one value per row: a batch key of its own (the legacy
    trainer's non_tensor_batch, or a tensor) or an entry of each row's `extra_fields` (verl V1); None if absent."""
    if key in data.keys():
        return _as_list(data[key])
    if EXTRA_FIELDS_KEY not in data.keys():
        return None
    rows = [getattr(row, "data", row) for row in _as_list(data[EXTRA_FIELDS_KEY])]
    found = [isinstance(row, dict) and key in row for row in rows]
    if not any(found):
        return None
    if not all(found):
        raise KeyError(f"verl's batch has {key!r} ({what}) in the extra_fields of some rows but not of row "
                       f"{found.index(False)}; every row must come from dllm_fast's verl rollout.")
    return [row[key] for row in rows]


def _unmask_steps(data, B: int, R: int) -> tuple[torch.Tensor, int | None]:
    what = "the rollout's decoding order, which dllm_fast's verl rollout records with record_unmask_step=true"
    rows = rollout_field(data, UNMASK_STEP_KEY, what)
    if rows is None:
        _field(data, UNMASK_STEP_KEY, what)  # raises, naming the key
    steps = [torch.as_tensor(row) for row in rows]
    if len(steps) != B or any(step.shape != (R,) for step in steps):
        raise ValueError(f"verl's batch field {UNMASK_STEP_KEY!r} must hold one int64 [response_length] = [{R}] "
                         f"array per row for {B} rows, got shapes {[tuple(step.shape) for step in steps][:4]}.")
    forwards = rollout_field(data, FORWARDS_KEY, "the rollout's forward count")
    return torch.stack(steps).long(), None if forwards is None else max(int(f) for f in forwards)


def _row_rewards(data) -> torch.Tensor:
    """[B] each row's reward: its summed `token_level_rewards`, or verl V1's `rm_scores` where that trainer writes
    no token_level_rewards (it does only with algorithm.use_kl_in_reward, and its advantages read rm_scores)."""
    key = "token_level_rewards" if "token_level_rewards" in data.keys() or "rm_scores" not in data.keys() \
        else "rm_scores"
    rewards = _field(data, key, "the rewards")
    return torch.stack([row.sum() for row in rewards.unbind()]) if _is_nested(rewards) else rewards.sum(-1)


def rows_from_verl(data, *, eos_token_id: int, device: torch.device, grouped: bool,
                   group_sizes: Counter | None = None, unmask_step: bool = False) -> VerlRows:
    """The rows of verl's batch (either layout, `padded_tokens`) as a RolloutBatch on `device`.

    grouped: the rows must hold whole prompt groups of one size G (the update: advantages are per group), each
    uid's count equal to `group_sizes[uid]` (the whole batch's, counted when the old policy was scored) when
    given; rewards are the rows' summed rewards (`_row_rewards`). Not grouped (scoring): group_size 1 and zero
    rewards, which scoring does not read. unmask_step: read `dllm_fast_unmask_step` (trajectory objectives)."""
    prompts, prompt_real, responses, response_real = padded_tokens(data)
    B, P = prompts.shape
    R = responses.shape[1]
    uids = uid_list(data)
    if len(uids) != B:
        raise ValueError(f"verl's batch has {len(uids)} uids for {B} rows.")
    order = _grouped_order(uids) if grouped else list(range(B))
    index = torch.tensor(order, dtype=torch.long)
    prompt_real = prompt_real.to(device)[index].long()
    response_real = response_real.to(device)[index]
    completion = responses.to(device)[index].long().masked_fill(~response_real, eos_token_id)
    sequences = torch.cat([prompts.to(device)[index].long(), completion], dim=1)
    full_attention = torch.cat([prompt_real, torch.ones_like(completion)], dim=1)
    steps = forwards = None
    if unmask_step:
        steps, forwards = _unmask_steps(data, B, R)
        steps = steps.to(device)[index]
    group_size = 1
    rewards = torch.zeros(B, dtype=torch.float32, device=device)
    uids = [uids[i] for i in order]
    if grouped:
        group_size = _group_size(uids, group_sizes)
        rewards = _row_rewards(data).to(device)[index].float()
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


def portable_rows(data, *, rewards: bool, advantages: bool, unmask_step: bool,
                  lp_old: torch.Tensor | None = None) -> list[dict]:
    """The rows of verl's batch (either layout) as plain per-row values, to send to other data-parallel ranks:
    uid, the prompt's and the response's tokens (padding dropped), and as asked the row's reward
    (`_row_rewards`), verl's advantage (one per row, checked), the rollout's decoding order and forward count, and
    the old policy's lp [n_t, L] (`lp_old`, in verl's row order). `rows_of_portable` reads them back."""
    prompts, prompt_real, responses, response_real = padded_tokens(data)
    uids = uid_list(data)
    B = len(uids)
    out = [{"uid": uids[n], "prompt": prompts[n][prompt_real[n]].cpu(),
            "response": responses[n][response_real[n]].cpu()} for n in range(B)]
    if rewards:
        for row, value in zip(out, _row_rewards(data).double().cpu()):
            row["reward"] = float(value)
    if advantages:
        values = _padded(_field(data, "advantages", "verl's advantages"), 0.0)
        mask = _padded(_field(data, "response_mask", "which response positions are scored"), 0)
        for row, value in zip(out, sequence_advantages(values.double(), mask.bool()).cpu()):
            row["advantage"] = float(value)
    if unmask_step:
        what = "the rollout's decoding order, which dllm_fast's verl rollout records with record_unmask_step=true"
        steps = rollout_field(data, UNMASK_STEP_KEY, what)
        if steps is None:
            _field(data, UNMASK_STEP_KEY, what)  # raises, naming the key
        forwards = rollout_field(data, FORWARDS_KEY, "the rollout's forward count")
        for n, row in enumerate(out):
            row[UNMASK_STEP_KEY] = torch.as_tensor(steps[n]).long().cpu()
            if forwards is not None:
                row[FORWARDS_KEY] = int(forwards[n])
    if lp_old is not None:
        for row, value in zip(out, lp_old.detach().cpu()):
            row["lp_old"] = value
    return out


def rows_of_portable(rows: list[dict]) -> dict:
    """`portable_rows`' rows as a batch `rows_from_verl` and `verl_advantages` read (verl V1's nested layout)."""
    def nested(name):
        return torch.nested.as_nested_tensor([row[name] for row in rows], layout=torch.jagged)

    data = {"uid": [row["uid"] for row in rows], "prompts": nested("prompt"), "responses": nested("response")}
    if "reward" in rows[0]:
        data["token_level_rewards"] = torch.tensor([[row["reward"]] for row in rows], dtype=torch.float64)
    if "advantage" in rows[0]:
        data["advantages"] = torch.tensor([[row["advantage"]] for row in rows], dtype=torch.float64)
        data["response_mask"] = torch.ones(len(rows), 1, dtype=torch.long)
    if UNMASK_STEP_KEY in rows[0]:
        data[UNMASK_STEP_KEY] = [row[UNMASK_STEP_KEY] for row in rows]
        if FORWARDS_KEY in rows[0]:
            data[FORWARDS_KEY] = [row[FORWARDS_KEY] for row in rows]
    return data


def share_of_groups(parts: list[list[dict]], rank: int, group_sizes: Counter) -> list[dict]:
    """This rank's rows of one mini-batch whose rows are spread over the data-parallel ranks (`parts[r]`: rank r's
    rows, `portable_rows`): its own rows where every rank's rows are whole prompt groups, else the same number of
    whole groups for each rank, in order of first appearance. Refused, naming the settings, where a group is not
    whole within the ranks' mini-batch (`group_sizes`: the step's, counted when the old policy was scored) or the
    groups cannot be shared out evenly."""
    everyone = [row for part in parts for row in part]
    counts = Counter(row["uid"] for row in everyone)
    for uid, count in counts.items():
        whole = group_sizes.get(uid)
        if whole is not None and whole != count:
            raise ValueError(f"the data-parallel ranks' mini-batch holds {count} of prompt {uid!r}'s {whole} "
                             "completions: verl's V1 trainer spreads a step's rows over the ranks by length, whatever "
                             "their prompt (it does not read trainer.balance_batch), so only the whole step holds "
                             "each group; the objective's advantages (and wd1's softmax) are per prompt group. Set "
                             "actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size (one mini-batch per "
                             "step; ppo_epochs for more updates) and actor_rollout_ref.actor.shuffle=false.")
    if all(Counter(row["uid"] for row in part) == Counter({uid: counts[uid] for uid in {row["uid"] for row in part}})
           for part in parts):
        return parts[rank]
    groups: dict[str, list[dict]] = {}
    for row in everyone:
        groups.setdefault(row["uid"], []).append(row)
    if len(groups) % len(parts):
        raise ValueError(f"the data-parallel ranks' mini-batch holds {len(groups)} prompt groups, which {len(parts)} "
                         "ranks cannot share evenly (the engine gives each rank whole groups, as many on each): set "
                         f"data.train_batch_size (prompts) to a multiple of {len(parts)}, with "
                         "actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size.")
    per_rank = len(groups) // len(parts)
    return [row for group in list(groups.values())[rank * per_rank:(rank + 1) * per_rank] for row in group]


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
    from `row_keys`), on the batch's device; a sampler that draws nothing replays the whole batch at once.

    Each row is drawn on its own tokens, without its prompt's left padding, and padded back: a row's masks must not
    depend on which other rows share its batch, whose longest prompt sets the padding (under several
    data-parallel ranks each rank pads to its own rows; a sampler that perturbs the prompt draws one number per
    prompt position)."""
    eos = getattr(model, "eos_token_id", None)
    blocks = block_length(model)
    if not SAMPLERS[objective.config.sampler].random:
        return objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=eos, model_block_length=blocks)
    paddings = ([0] * len(keys) if batch.attention_mask is None
                else (batch.attention_mask[:, :batch.prompt_length] == 0).sum(-1).tolist())
    parts = []
    for n, (key, padding) in enumerate(zip(keys, paddings)):
        generator = torch.Generator().manual_seed(row_seed(seed, key))
        masks = objective.draw_masks(_one_row(batch, n, padding), generator=generator, eos_token_id=eos,
                                     model_block_length=blocks)
        parts.append(_left_padded(masks, padding))
    masks = cat_masks(parts)
    if masks.fingerprint is None:
        return masks
    return dataclasses.replace(masks, fingerprint=sequence_fingerprint(batch.sequences))  # the padded rows'


def _one_row(batch: RolloutBatch, n: int, padding: int) -> RolloutBatch:
    """Row n alone, without the `padding` positions of its prompt's left padding."""
    part = slice(n, n + 1)
    return RolloutBatch(sequences=batch.sequences[part, padding:], attention_mask=None,
                        prompt_length=batch.prompt_length - padding, completion_mask=batch.completion_mask[part],
                        rewards=batch.rewards[part], group_size=1,
                        unmask_step=None if batch.unmask_step is None else batch.unmask_step[part],
                        forwards=batch.forwards)


def _left_padded(masks: MonteCarloMasks, padding: int) -> MonteCarloMasks:
    """A row's masks drawn without its prompt padding, padded back: the padding is never masked; the other fields
    index the completion or the sample and stay as drawn (the fingerprint is replaced by the caller)."""
    if padding == 0:
        return masks
    return dataclasses.replace(masks, masked=torch.nn.functional.pad(masks.masked, (padding, 0), value=False),
                               prompt_length=masks.prompt_length + padding)


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
    advantages = _padded(_field(data, "advantages", "verl's advantages"), 0.0)
    mask = _padded(_field(data, "response_mask", "which response positions are scored"), 0)
    index = torch.tensor(rows.order, dtype=torch.long)
    return sequence_advantages(advantages[index].double(), mask[index].bool())
