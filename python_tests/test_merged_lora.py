"""Merged rollouts (models/merged_lora.py, issue 38 item 4): a LoRA policy rolls out through a copy of its adapted
weights with the adapters merged in. In fp64 the rollouts equal the adapters' token for token, also after an
optimizer step moved the adapters (the copy is refreshed in place, at the same addresses); in bf16 the merged
weights are PEFT's own merge, bit for bit; every weight that is not adapted is shared."""

import copy

import pytest
import torch

import dllm_fast
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.models.llada import LORA_TARGETS
from dllm_fast.models.merged_lora import merged_for_rollouts

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


def lora_policy(dtype=torch.float64, targets=LORA_TARGETS, **options):
    torch.manual_seed(0)
    model = LLaDAModel(LLaDAConfig.preset("tiny")).to(dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_pattern(targets),
                             init_lora_weights=False, **options)
    return peft.get_peft_model(model, config)


def rollout(model, prompts, temperature):
    return dllm_fast.generate(model, prompts, gen_length=16, block_length=8, steps=8, cache="dual",
                              temperature=temperature, generator=torch.Generator().manual_seed(3)).completion_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_merged_rollouts_equal_the_adapters_in_float64_also_after_a_step(temperature):
    policy = lora_policy()
    prompts = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = policy(prompts)
    merged = merged_for_rollouts(policy)
    with torch.no_grad():
        torch.testing.assert_close(merged(prompts), hidden, rtol=1e-12, atol=1e-12)
    assert torch.equal(rollout(merged, prompts, temperature), rollout(policy, prompts, temperature))
    addresses = [p.data_ptr() for p in merged.parameters()]
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    policy(prompts).square().mean().backward()
    optimizer.step()
    assert merged_for_rollouts(policy) is merged and [p.data_ptr() for p in merged.parameters()] == addresses
    moved = rollout(policy, prompts, temperature)
    assert torch.equal(rollout(merged, prompts, temperature), moved)
    with torch.no_grad():
        torch.testing.assert_close(merged(prompts), policy(prompts), rtol=1e-12, atol=1e-12)


def test_bf16_merged_weights_are_peft_merge_and_the_rest_is_shared():
    policy = lora_policy(torch.bfloat16, targets=("q_proj", "v_proj", "up_proj", "ff_out"))
    for name, parameter in policy.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()  # train's fp32 adapters on a bf16 base
    merged = merged_for_rollouts(policy)
    want = copy.deepcopy(policy).merge_and_unload().state_dict()  # PEFT's merge, in place
    got = merged.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in want)
    shared = {p.data_ptr() for p in policy.parameters()}
    adapted = {id(p) for p in merged.parameters() if p.data_ptr() not in shared}
    assert len(adapted) == 3 * len(policy.base_model.model.transformer["blocks"])  # q/k/v, gate/up, ff_out
    assert sum(p.data_ptr() in shared for p in merged.parameters()) > 0  # embeddings, norms, head, attn_out
    assert not any(p.requires_grad for p in merged.parameters() if id(p) in adapted)


def test_no_recomputation_while_nothing_moved_and_refusals():
    policy = lora_policy()
    merged = merged_for_rollouts(policy)
    state = next(iter(merged.parameters()))
    before = [p.clone() for p in merged.parameters()]
    with torch.no_grad():
        policy.base_model.model.transformer["blocks"][0].q_proj.lora_B["default"].weight.add_(1.0)
    merged_for_rollouts(policy)
    assert not all(torch.equal(p, b) for p, b in zip(merged.parameters(), before))  # refreshed: the adapter moved
    assert state is next(iter(merged.parameters()))
    with pytest.raises(ValueError, match="PEFT LoRA model"):
        merged_for_rollouts(LLaDAModel(LLaDAConfig.preset("tiny")))
    with pytest.raises(ValueError, match="DoRA"):
        merged_for_rollouts(lora_policy(use_dora=True))


def test_the_training_step_rolls_out_through_the_merged_copy(monkeypatch):
    from dllm_fast.rollout.config import GenerateConfig
    from dllm_fast.train import step as train_step

    policy = lora_policy()
    prompts = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    config = GenerateConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    seen = []
    monkeypatch.setattr(train_step, "generate", lambda model, *args, **kwargs: seen.append(model))
    for merge in (False, True):
        train_step.roll_out(policy, prompts, torch.ones_like(prompts), config, generator=torch.Generator(),
                            record_unmask_step=False, merge_adapters=merge)
    assert seen[0] is policy and seen[1] is merged_for_rollouts(policy)


def test_a_lora_run_with_merged_rollouts_trains_and_samples_through_the_merged_copy(tmp_path, monkeypatch):
    """--lora-merge-rollouts true: every training rollout samples through the merged copy, refreshed after each
    optimizer step (two steps: the second rollout sees the first step's adapters)."""
    from dllm_fast.models import merged_lora
    from dllm_fast.train import train
    from test_trainer import quick_config

    refreshed = []
    original = merged_lora._Merged.refresh
    monkeypatch.setattr(merged_lora._Merged, "refresh",
                        lambda self: refreshed.append(self._state() != self.state) or original(self))
    train(quick_config(tmp_path, lora=True, lora_rank=4, lora_merge_rollouts=True, steps=2, eval_every=10,
                       checkpoint_every=10, eval_examples=4))
    assert refreshed == [True, True]
