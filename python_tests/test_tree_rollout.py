"""d-TreeRPO's tree rollout (rollout/tree.py): the tree's shape and canvases, node values and sibling advantages."""

import pytest
import torch

import dllm_fast
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.rollout.config import GenerateConfig
from dllm_fast.rollout.tree import TreeShape, node_values, sibling_advantages, tree_rollout


def tiny_model():
    torch.manual_seed(0)
    return LLaDAModel(LLaDAConfig.preset("tiny")).to(dtype=torch.float64).eval()


def test_the_notes_property_values_and_leave_one_out_advantages():
    """branch 2, contraction 2, 2 root children; leaves (1, 0) under a and (0, 0) under b: V(a) = 0.5, V(b) = 0,
    A(a) = 0.5, A(b) = -0.5, A(a's leaves) = +-1, A(b's leaves) = 0."""
    # nodes: root 0; a = 1, b = 2; a's leaves 3, 4; b's leaves 5, 6
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    level = torch.tensor([0, 1, 1, 2, 2, 2, 2])
    values = node_values(parent, level, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert values.tolist() == [0.25, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert sibling_advantages(parent, values).tolist() == [0.0, 0.5, -0.5, 1.0, -1.0, 0.0, 0.0]


def test_leave_one_out_with_three_siblings_and_nan_values():
    parent = torch.tensor([-1, 0, 0, 0, 1, 2, 3, 3])
    level = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2])
    values = node_values(parent, level, torch.tensor([1.0, float("nan"), 0.0, 1.0]))
    assert values[1].item() == 1.0 and values[2].isnan() and values[3].item() == 0.5
    advantage = sibling_advantages(parent, values)
    # node 1: 1 - mean(0.5) (node 2 is NaN and left out); node 2: NaN -> 0; node 4: only child -> 0
    assert advantage.tolist() == [0.0, 0.5, 0.0, -0.5, 0.0, 0.0, -1.0, 1.0]


def test_tree_shape_counts_and_branch_steps():
    shape = TreeShape()  # the official 4 x 4 with 2 levels
    assert shape.nodes_per_prompt() == [1, 4, 16]
    assert shape.edges_per_prompt() == 20 and shape.leaves_per_prompt() == 16
    assert shape.branch_steps(128) == [0, 64, 128]
    assert TreeShape(contraction=3).branch_steps(8) == [0, 2, 5, 8]
    with pytest.raises(ValueError, match="tree_contraction=9 exceeds steps=8"):
        TreeShape(contraction=9).branch_steps(8)
    with pytest.raises(ValueError, match="tree_branch=0 must be an int >= 1"):
        TreeShape(branch=0)


def test_a_chain_decodes_the_uninterrupted_rollout_and_siblings_branch():
    model = tiny_model()
    ids = torch.randint(0, 120, (2, 3), generator=torch.Generator().manual_seed(1))
    config = GenerateConfig(gen_length=8, block_length=4, steps=4)
    chain = tree_rollout(dllm_fast.generate, model, ids, None, config, TreeShape(branch=1, contraction=3,
                                                                                 root_children=1))
    whole = dllm_fast.generate(model, ids, None, config)
    assert torch.equal(chain.canvases[chain.leaves], whole.sequences)
    assert chain.done_steps == (0, 1, 2, 4) and chain.forwards == whole.nfe

    sampled = GenerateConfig(gen_length=8, block_length=4, steps=4, temperature=1.0)
    tree = tree_rollout(dllm_fast.generate, model, ids, None, sampled, TreeShape(branch=2, contraction=2,
                                                                                 root_children=2),
                        generator=torch.Generator().manual_seed(0))
    assert tree.num_nodes == 2 * (1 + 2 + 4)
    assert tree.prompt.tolist() == [0, 1, 0, 0, 1, 1] + [0] * 4 + [1] * 4
    mask = model.mask_token_id
    for node in tree.edges.tolist():  # a child keeps its parent's decoded tokens and decodes 2 steps more
        child, above = tree.canvases[node], tree.canvases[tree.parent[node]]
        decoded = above != mask
        assert torch.equal(child[decoded], above[decoded])
        assert int((child == mask).sum()) == int((above == mask).sum()) - 4
    leaves = tree.canvases[tree.leaves]
    assert not (leaves == mask).any()
    assert torch.equal(leaves[:, :3], ids[tree.prompt[tree.leaves]])
    assert len({tuple(row.tolist()) for row in leaves}) > 2  # siblings sample their own noise
