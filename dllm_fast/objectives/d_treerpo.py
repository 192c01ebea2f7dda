"""d-TreeRPO (Pan et al. 2025, arXiv 2512.09675; official code THU-BPM/d-TreeRPO dtreerpo/dtreerpo_trainer.py,
DARE's port dtreerpo_algos.py): PPO on the edges of a tree rollout (rollout/tree.py), with a self-distillation
term toward each parent's better children.

Each sequence of the batch is one edge parent -> child (`TreeBatch`, built by `tree_batch`): lp_i = log p(child_i |
parent) by one forward on the parent's canvas, at act = {parent masked, child decoded, i <= the child's first EOS}
(the `tree_edge` sampler), T = 1. A is the child's sibling advantage (V(child) - mean of its siblings' V).

    loss = (1/E) sum_edges (1/|act|) sum_act [ -min(rho A, clip(rho, 1 +- eps) A) + beta k3(lp_ref - lp) ]
           + lambda(t) L_SD
    L_SD = mean over (parent, j) of sum_v q_j(v) (log q_j(v) - log p(v | parent)),
    q_j(v) ∝ sum of w_k over the parent's children k with A_k > 0 active at j with token v,  w = softmax(A / tau(t))
    lambda(t) = lambda_max (e^{gamma t/T} - 1) / (e^gamma - 1),  tau(t) = max(tau_max (1 - t/T)^beta_tau, 1e-6)

(j ranges over the positions active in any positive child of the parent; t: the training step the tree was
rolled out at, T: self_distillation_steps, the official max_steps.) Every child of a parent is scored on the same
canvas, so log p(v | parent) at j is the lp of any child holding v there: L_SD = const - sum_k sum_j (w_k / W_j)
lp_kj / #(parent, j), with W_j the positive weight active at j. It is linear in lp, so the loss is a sum of
per-edge terms (separable, one scoring pass). With one positive child and tau -> 0 it is -mean_j log p(child_j |
parent).

Defaults: the official yaml (slurm_scripts/dtreerpo.yaml) and trainer: branch 4, contraction 2, 4 root children,
eps 0.4, beta 0.01 (k3 against the base model), lambda_max 3e-3, gamma 2, tau_max 2, beta_tau 0.7, T 30000. The
rollout itself (T 0.9, 128 steps) is the trainer's --temperature and --steps. Deviations: |act| is the count of
act positions (the official code recounts it as lp != 0, which drops a token of probability exactly 1); the
official reuse of parent buckets (parents_per_step) is the trainer's inner updates (--inner-updates mu, every edge
each time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import MaskSpec, MonteCarloMasks, sample_masks
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped,
                                       clipped_surrogate, kl_k3, mask_defaults)
from dllm_fast.rollout.tree import Tree, TreeShape, node_values, sibling_advantages
from dllm_fast.validation import check_float, check_int

# The tree_edge sampler's stages of a completion position relative to an edge (likelihood/samplers.py).
BEFORE_EDGE, DECODED_BY_EDGE, NOT_READ = 0, 1, 2


@dataclass(frozen=True, eq=False)
class TreeBatch(RolloutBatch):
    """A RolloutBatch of a tree's edges (`tree_batch`): row e is the edge to a child node, its sequence the child's
    canvas (the masked positions hold EOS, never read), unmask_step its positions' stages (tree_edge), rewards the
    child's value V. advantages: [E] float64 the child's sibling advantage; sibling_group: [E] int64 the parent
    node (the children of one parent share it); train_step: the training step of the rollout (the
    self-distillation schedule's t). group_size: edges per prompt (rows of a prompt are contiguous)."""

    advantages: torch.Tensor | None = None
    sibling_group: torch.Tensor | None = None
    train_step: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        N = self.num_rollouts
        if self.advantages is None or tuple(self.advantages.shape) != (N,):
            raise ValueError(f"TreeBatch.advantages must be a [{N}] tensor of the edges' sibling advantages.")
        if self.sibling_group is None or tuple(self.sibling_group.shape) != (N,):
            raise ValueError(f"TreeBatch.sibling_group must be a [{N}] tensor of the edges' parent nodes.")
        check_int("TreeBatch.train_step", self.train_step, minimum=0)


def tree_batch(tree: Tree, leaf_rewards: torch.Tensor, *, eos_token_id: int, mask_token_id: int,
               train_step: int = 0) -> TreeBatch:
    """The edges of `tree` with its leaves' rewards (in the order of tree.leaves) as a TreeBatch, prompt by prompt."""
    values = node_values(tree.parent, tree.level, leaf_rewards)
    advantages = sibling_advantages(tree.parent, values)
    edges = tree.edges
    edges = edges[torch.sort(tree.prompt[edges], stable=True).indices]
    P = tree.prompt_length
    child = tree.canvases[edges]
    parent = tree.canvases[tree.parent[edges]]
    child_completion, parent_completion = child[:, P:], parent[:, P:]
    # act: masked in the parent, decoded in the child, up to its first EOS (mask tokens are no EOS)
    real = completion_mask(child_completion, eos_token_id)
    act = (parent_completion == mask_token_id) & (child_completion != mask_token_id) & real
    stage = torch.where(parent_completion != mask_token_id, BEFORE_EDGE, torch.where(act, DECODED_BY_EDGE, NOT_READ))
    sequences = child.masked_fill(child == mask_token_id, eos_token_id)
    prompts = tree.prompt[edges]
    num_prompts = int(tree.prompt.max()) + 1
    return TreeBatch(sequences=sequences,
                     attention_mask=None if tree.attention_mask is None else tree.attention_mask[prompts],
                     prompt_length=P, completion_mask=real, rewards=torch.nan_to_num(values[edges]).float(),
                     group_size=edges.shape[0] // num_prompts, unmask_step=stage.long(), forwards=3,
                     advantages=advantages[edges], sibling_group=tree.parent[edges], train_step=train_step)


def distillation_schedule(step: int, *, lambda_max: float, gamma: float, tau_max: float, tau_power: float,
                          steps: int) -> tuple[float, float]:
    """(lambda(t), tau(t)) at training step t = step (clamped to steps): the official trainer's L824-831."""
    fraction = min(step, steps) / steps
    lam = lambda_max * fraction if gamma == 0 else lambda_max * math.expm1(gamma * fraction) / math.expm1(gamma)
    tau = max(tau_max * (1.0 - fraction) ** tau_power, 1e-6)
    return lam, tau


def distillation_weights(advantages: torch.Tensor, groups: torch.Tensor, act: torch.Tensor, tokens: torch.Tensor,
                         tau: float) -> tuple[torch.Tensor, float, int]:
    """The self-distillation term as constants: (c [E, L] with L_SD = entropy - sum c lp / pairs, entropy the
    summed sum_v q log q, pairs the number of (parent, position) pairs). w = softmax(A / tau) over each parent's
    children with A > 0; c_kj = w_k / W_j at the positions j child k is active at."""
    E, L = act.shape
    positive = advantages > 0
    scaled = torch.where(positive, advantages.double() / tau, float("-inf"))
    num_groups = int(groups.max()) + 1 if E else 0
    top = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=act.device)
    top = top.scatter_reduce(0, groups, scaled, reduce="amax")
    weights = torch.where(positive, torch.exp(scaled - top[groups]), 0.0)  # softmax numerators per group
    active = act & positive[:, None]
    w_active = weights[:, None] * active  # [E, L]
    totals = torch.zeros((num_groups, L), dtype=torch.float64, device=act.device).index_add_(0, groups, w_active)
    coefficient = torch.where(active, w_active / totals[groups].clamp_min(1e-300), 0.0)
    pairs = int((totals > 0).sum())
    # sum_v q log q: q_j(v) sums the coefficients of the children holding v at j, one key per (parent, j, v)
    k, j = active.nonzero(as_tuple=True)
    keys = (groups[k] * L + j) * (int(tokens.max()) + 1) + tokens[k, j]
    q = torch.zeros(k.shape[0], dtype=torch.float64, device=act.device).index_add_(
        0, torch.unique(keys, return_inverse=True)[1], coefficient[k, j])
    q = q[q > 0]
    entropy = float((q * q.log()).sum())
    return coefficient, entropy, pairs


@dataclass
class DTreeRPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="tree_edge", count="all")
    epsilon: float = field(default=0.4, metadata={"help": "PPO clip range of the token ratio"})
    beta: float = field(default=0.01, metadata={"help": "k3 KL coefficient against the reference (base) model"})
    tree_branch: int = field(default=4, metadata={"help": "children of each internal node below the root"})
    tree_contraction: int = field(default=2, metadata={"help": "levels of the tree (the schedule cut in this many)"})
    tree_root_children: int = field(default=4, metadata={"help": "children of each prompt's root"})
    self_distillation_lambda: float = field(default=3e-3, metadata={"help": "lambda_max of the self-distillation "
                                                                          "term (0 turns it off)"})
    self_distillation_gamma: float = field(default=2.0, metadata={"help": "lambda(t)'s exponential ramp"})
    self_distillation_tau: float = field(default=2.0, metadata={"help": "tau_max, softmax(A / tau) temperature"})
    self_distillation_tau_power: float = field(default=0.7, metadata={"help": "tau(t) = tau_max (1 - t/T)^power"})
    self_distillation_steps: int = field(default=30000, metadata={"help": "T of the schedules (official max_steps)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        self.tree_shape()
        check_float("self_distillation_lambda", self.self_distillation_lambda, minimum=0.0)
        check_float("self_distillation_gamma", self.self_distillation_gamma, minimum=0.0)
        check_float("self_distillation_tau", self.self_distillation_tau, minimum=0.0, open_minimum=True)
        check_float("self_distillation_tau_power", self.self_distillation_tau_power, minimum=0.0)
        check_int("self_distillation_steps", self.self_distillation_steps, minimum=1)

    def tree_shape(self) -> TreeShape:
        return TreeShape(self.tree_branch, self.tree_contraction, self.tree_root_children)


class DTreeRPO(Objective):
    name = "d_treerpo"
    Config = DTreeRPOConfig
    uses_old_policy = True
    separable = True

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def tree_shape(self) -> TreeShape:
        """The tree the trainer rolls out for this objective (rollout/tree.py)."""
        return self.config.tree_shape()

    def schedule(self, step: int) -> tuple[float, float]:
        c = self.config
        return distillation_schedule(step, lambda_max=c.self_distillation_lambda, gamma=c.self_distillation_gamma,
                                     tau_max=c.self_distillation_tau, tau_power=c.self_distillation_tau_power,
                                     steps=c.self_distillation_steps)

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        _check_tree_batch(batch)
        return batch.advantages.double()

    def draw_masks(self, batch: RolloutBatch, *, generator: torch.Generator, eos_token_id: int | None,
                   model_block_length: int | None = None) -> MonteCarloMasks:
        _check_tree_batch(batch)
        return sample_masks(batch.sequences, self.config.masks, prompt_length=batch.prompt_length,
                            generator=generator, eos_token_id=eos_token_id, attention_mask=batch.attention_mask,
                            unmask_step=batch.unmask_step)

    def extra(self, batch, masks):
        _check_tree_batch(batch)
        act = masks.target[:, 0]  # [E, L]
        lam, tau = self.schedule(batch.train_step)
        coefficient, entropy, pairs = (None, 0.0, 0)
        if lam > 0:
            coefficient, entropy, pairs = distillation_weights(
                batch.advantages.to(act.device), batch.sibling_group.to(act.device), act,
                batch.sequences[:, batch.prompt_length:], tau)
        return {"act_tokens": act.sum(-1).double(), "edges": float(act.shape[0]), "sd_lambda": lam, "sd_tau": tau,
                "sd_coefficient": coefficient, "sd_entropy": entropy, "sd_pairs": pairs}

    def token_terms(self, lp, old, ref, advantage, target):
        c = self.config
        ratio = torch.exp(lp - old)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        gain = torch.where(target, clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon), zero)
        kl = torch.where(target, kl_k3(ref - lp), zero) if ref is not None else torch.zeros_like(lp)
        return gain, kl, ratio, clipped(ratio, advantage, c.epsilon, c.epsilon) & target

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        target = inputs.masks.target[sequence, sample]
        old = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample].to(lp_pairs.dtype)
        ref = inputs.ref(lp_pairs)[sequence, sample] if self.config.beta > 0 else None
        advantage = inputs.advantage(lp_pairs)[sequence, None]
        gain, kl, _, _ = self.token_terms(lp_pairs, old, ref, advantage, target)
        extra = inputs.extra
        tokens = extra["act_tokens"].to(lp_pairs.dtype)[sequence].clamp_min(1)
        terms = ((-gain.sum(-1) + self.config.beta * kl.sum(-1)) / tokens).sum() / extra["edges"]
        if extra["sd_pairs"]:
            coefficient = extra["sd_coefficient"].to(lp_pairs.dtype)[sequence]
            share = lp_pairs.shape[0] / (extra["edges"] * inputs.masks.n_t)  # the constant, spread over the pairs
            terms = terms + extra["sd_lambda"] * (share * extra["sd_entropy"] - (coefficient * lp_pairs).sum()
                                                  ) / extra["sd_pairs"]
        return terms

    def stats(self, lp, inputs):
        target = inputs.masks.target
        ref = inputs.ref(lp) if self.config.beta > 0 else None
        _, kl, ratio, clip = self.token_terms(lp, inputs.old(lp), ref, inputs.advantage(lp)[:, None, None], target)
        tokens = target.sum().clamp_min(1)
        extra = inputs.extra
        sd = torch.zeros((), dtype=torch.float64)
        if extra["sd_pairs"]:
            sd = (extra["sd_entropy"] - (extra["sd_coefficient"].to(lp.dtype) * lp[:, 0]).sum()) / extra["sd_pairs"]
        return {"ratio_mean": ratio[target].mean(), "clip_fraction": clip.sum() / tokens,
                "kl_ref": kl.sum() / tokens, "self_distillation": sd,
                "self_distillation_lambda": torch.tensor(extra["sd_lambda"]),
                "self_distillation_tau": torch.tensor(extra["sd_tau"]),
                "act_tokens_per_edge": tokens / target.shape[0]}


def _check_tree_batch(batch) -> None:
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"d_treerpo trains on the edges of a tree rollout: pass a TreeBatch (objectives.d_treerpo."
                        f"tree_batch(rollout.tree.tree_rollout(...), leaf_rewards, ...)), got {type(batch).__name__}.")
