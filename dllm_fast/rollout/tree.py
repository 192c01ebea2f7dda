"""d-TreeRPO's tree rollout (Pan et al. 2025; THU-BPM/d-TreeRPO dtreerpo_trainer.py): a tree of partial rollouts
per prompt, branching at fixed steps of the global schedule, with rewards at the leaves, node values and
leave-one-out sibling advantages.

With K = steps and s = contraction, the tree branches after d_k = floor(k K / s) steps, k = 0 .. s (the official
code's branch points b_k = K - d_k, counted as steps left). The root (the prompt, its completion masked) gets
`root_children` children, every other internal node `branch`; a child is its parent's canvas decoded on by the
same sampler for d_k - d_{k-1} steps (generate's resume options, rollout/resume.py), one generate call per level
with the children as rows (a row's noise words are its own, so siblings differ). The leaves, after all K steps,
are complete rollouts: they get the rewards.

    V(leaf) = R,  V(node) = nanmean over its children of V,  A(node) = V(node) - mean over its siblings of V

(siblings: the other children of its parent; A = 0 for a node without siblings, for a NaN value, or whose
siblings are all NaN). Every node's canvas is kept: the objective scores each edge (parent -> child) by one
forward on the parent's canvas (objectives/d_treerpo.py). Cost: sum over levels of nodes x steps sampler forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.rollout.config import GenerateConfig
from dllm_fast.rollout.plan import check_generate_config
from dllm_fast.rollout.resume import Resume
from dllm_fast.validation import check_int


@dataclass(frozen=True)
class TreeShape:
    """branch: children of every internal node below the root; contraction: the tree's depth s (levels of
    edges), one per segment of the schedule; root_children: children of each root. The defaults are the
    official scripts' (slurm_scripts/dtreerpo.yaml): 4 + 16 edges and 16 leaves per prompt."""

    branch: int = 4
    contraction: int = 2
    root_children: int = 4

    def __post_init__(self) -> None:
        check_int("tree_branch", self.branch, minimum=1, hint="children of each internal node below the root")
        check_int("tree_contraction", self.contraction, minimum=1, hint="levels of the tree (segments of the schedule)")
        check_int("tree_root_children", self.root_children, minimum=1, hint="children of each prompt's root")

    def children_at(self, level: int) -> int:
        """Children of each node of `level` (0: the roots)."""
        return self.root_children if level == 0 else self.branch

    def nodes_per_prompt(self) -> list[int]:
        """Nodes of each level, per prompt: 1, root_children, root_children x branch, ..."""
        counts = [1]
        for level in range(self.contraction):
            counts.append(counts[-1] * self.children_at(level))
        return counts

    def leaves_per_prompt(self) -> int:
        return self.nodes_per_prompt()[-1]

    def edges_per_prompt(self) -> int:
        return sum(self.nodes_per_prompt()[1:])

    def branch_steps(self, steps: int) -> list[int]:
        """d_k = floor(k K / s), k = 0 .. s: the global steps decoded at each level."""
        if self.contraction > steps:
            raise ValueError(f"tree_contraction={self.contraction} exceeds steps={steps}: every level decodes at least "
                             f"one step; lower tree_contraction to at most {steps}, or raise steps.")
        return [level * steps // self.contraction for level in range(self.contraction + 1)]


@dataclass(frozen=True, eq=False)
class Tree:
    """The nodes of the trees of a batch of prompts, level by level (roots first).

    canvases: [M, P + G] every node's canvas (masks where it is not decoded yet). parent: [M] int64, the index of
    the node's parent (-1 for a root). prompt: [M] int64, its prompt's row in the prompts. level: [M] int64.
    done_steps: [s + 1] the global steps decoded at each level. attention_mask: [num_prompts, P + G] or None.
    forwards: the sampler forwards the tree took.
    """

    canvases: torch.Tensor
    parent: torch.Tensor
    prompt: torch.Tensor
    level: torch.Tensor
    done_steps: tuple[int, ...]
    prompt_length: int
    attention_mask: torch.Tensor | None
    forwards: int

    @property
    def num_nodes(self) -> int:
        return self.canvases.shape[0]

    @property
    def depth(self) -> int:
        return len(self.done_steps) - 1

    @property
    def leaves(self) -> torch.Tensor:
        """[num_leaves] indices of the leaves (the complete rollouts), in order."""
        return (self.level == self.depth).nonzero().squeeze(1)

    @property
    def edges(self) -> torch.Tensor:
        """[num_edges] indices of every node but the roots: each names the edge from its parent to it."""
        return (self.parent >= 0).nonzero().squeeze(1)


@torch.no_grad()
def tree_rollout(generate, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 config: GenerateConfig, shape: TreeShape, *, generator: torch.Generator | None = None) -> Tree:
    """Grow one tree per prompt (input_ids [num_prompts, P], left-padded) with `generate` (dllm_fast.generate or
    its reference twin), decoding `config`'s fixed schedule in shape.contraction segments."""
    if not isinstance(shape, TreeShape):
        raise TypeError(f"shape must be a TreeShape, got {type(shape).__name__}.")
    plan = check_generate_config(model, config, prompt_length=input_ids.shape[1], batch=input_ids.shape[0])
    if plan.steps_per_block is None:
        raise ValueError("a tree rollout branches at fixed steps of the schedule; threshold decoding has none: pass "
                         "steps=... and threshold=None.")
    steps = plan.steps_per_block * (config.gen_length // config.block_length)
    done = shape.branch_steps(steps)
    num_prompts, device = input_ids.shape[0], input_ids.device
    masks = torch.full((num_prompts, config.gen_length), model.mask_token_id, dtype=torch.long, device=device)
    canvases = [torch.cat([input_ids.long(), masks], dim=1)]
    parents = [torch.full((num_prompts,), -1, dtype=torch.long, device=device)]
    prompts = [torch.arange(num_prompts, device=device)]
    first, forwards = 0, 0  # the index of the current level's first node
    for level in range(shape.contraction):
        repeat = shape.children_at(level)
        parent_canvas, parent_prompt = canvases[-1], prompts[-1]
        rows = parent_prompt.repeat_interleave(repeat)
        result = generate(model, input_ids[rows], None if attention_mask is None else attention_mask[rows], config,
                          generator=generator, resume=Resume(parent_canvas.repeat_interleave(repeat, dim=0),
                                                             done[level], done[level + 1] - done[level]))
        forwards += result.nfe
        canvases.append(result.sequences)
        parents.append(first + torch.arange(parent_canvas.shape[0], device=device).repeat_interleave(repeat))
        prompts.append(rows)
        first += parent_canvas.shape[0]
    levels = torch.cat([torch.full((c.shape[0],), k, dtype=torch.long, device=device) for k, c in enumerate(canvases)])
    full_mask = None
    if attention_mask is not None:
        full_mask = torch.cat([attention_mask.long(), torch.ones_like(masks)], dim=1)
    return Tree(torch.cat(canvases), torch.cat(parents), torch.cat(prompts), levels, tuple(done),
                input_ids.shape[1], full_mask, forwards)


def node_values(parent: torch.Tensor, level: torch.Tensor, leaf_rewards: torch.Tensor) -> torch.Tensor:
    """[M] float64 node values: the leaves' rewards (leaf_rewards in the order of the deepest level's nodes),
    every other node the nanmean of its children's values (NaN when all of them are NaN)."""
    depth = int(level.max())
    values = torch.full(parent.shape, float("nan"), dtype=torch.float64, device=parent.device)
    leaves = level == depth
    if leaf_rewards.shape != (int(leaves.sum()),):
        raise ValueError(f"leaf_rewards must hold one reward per leaf, [{int(leaves.sum())}], got shape "
                         f"{tuple(leaf_rewards.shape)}.")
    values[leaves] = leaf_rewards.to(device=parent.device, dtype=torch.float64)
    for k in range(depth - 1, -1, -1):
        children = (level == k + 1).nonzero().squeeze(1)
        child_values = values[children]
        finite = ~child_values.isnan()
        sums = torch.zeros_like(values).index_add_(0, parent[children], torch.where(finite, child_values, 0.0))
        counts = torch.zeros_like(values).index_add_(0, parent[children], finite.double())
        at_level = level == k
        values[at_level] = torch.where(counts[at_level] > 0, sums[at_level] / counts[at_level].clamp_min(1),
                                       float("nan"))
    return values


def sibling_advantages(parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[M] float64 A(node) = V(node) - mean of its siblings' values (the other children of its parent, NaN ones
    left out); 0 for roots, nodes without (finite) siblings, and nodes of NaN value."""
    edges = parent >= 0
    finite = ~values.isnan() & edges
    groups = parent.clamp_min(0)
    zero = torch.zeros_like(values)
    sums = zero.index_add(0, groups, torch.where(finite, values, 0.0))
    counts = zero.index_add(0, groups, finite.double())
    others_sum = sums[groups] - torch.where(finite, values, 0.0)
    others = counts[groups] - finite.double()
    advantage = values - others_sum / others.clamp_min(1)
    return torch.where(finite & (others > 0), advantage, zero)


def check_tree_rollouts(model, config: GenerateConfig, shape: TreeShape) -> None:
    """Raise, naming the setting and the fix, unless `config` can decode trees of `shape` on `model` (its skeleton
    will do): a fixed schedule with at least one step per level, a bidirectional model, eager steps, and with the
    prefix or dual cache branch points at block boundaries (rollout/resume.py). Trainers call it before any work."""
    from dllm_fast.contracts import block_length as block_length_of  # the model's blocks, if it has them

    plan = check_generate_config(model, config)
    if plan.steps_per_block is None:
        raise ValueError("tree rollouts branch at fixed steps of the schedule; threshold decoding has none: set "
                         "steps (e.g. --steps equal to --gen-length) and no threshold.")
    if block_length_of(model) is not None:
        raise ValueError("tree rollouts resume partly decoded canvases, which block-diffusion models (SDAR, LLaDA2) "
                         "do not support here; use a bidirectional model (LLaDA, Dream).")
    if plan.compile:
        raise ValueError("tree rollouts resume canvases eagerly; turn compiled rollouts off (compile=False).")
    steps = plan.steps_per_block * (config.gen_length // config.block_length)
    done = shape.branch_steps(steps)
    if plan.cache.uses_cache:
        inside = [d for d in done if 0 < d % plan.steps_per_block < plan.step_limit(config.block_length)]
        if inside:
            raise ValueError(f"cache={plan.cache.name!r} resumes only at block boundaries, but the tree branches "
                             f"after {inside[0]} steps, inside a block of {plan.steps_per_block} steps; choose steps "
                             f"and tree_contraction so that each floor(k steps / contraction) is a multiple of "
                             "steps per block, or use cache='none'.")
