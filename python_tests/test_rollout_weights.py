"""Rollouts that gather once (train/rollout_weights.py), on CPU with gloo and 2 ranks in fp64: a rollout on the
plain copy gathered once gives the tokens of the rollout on FSDP2's per-forward gathers at T = 0 (full fine-tune,
LoRA through the adapters and LoRA merged), with one all-gather a unit a rollout instead of one a unit a forward;
the expert-parallel seam (shared expert modules, not copied); the rules that choose the path and keep the copy."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch

from dllm_fast.testing.ranks import run_ranks
from dllm_fast.train.rollout_rule import ROLLOUT_MARGIN, keep_copy, rollout_path

WORLD = 2


def make_model(family: str):
    from dllm_fast.models import LLaDAConfig, LLaDAModel
    from dllm_fast.models.llada2 import LLaDA2Model

    torch.manual_seed(0)
    if family == "llada2":
        return LLaDA2Model(LLaDA2Model.preset_config("llada2-tiny")).double()
    return LLaDAModel(LLaDAConfig.preset("tiny")).double()


def with_lora(model):
    import peft

    policy = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=model.lora_target_pattern(
        model.lora_target_modules)))
    torch.manual_seed(1)
    for name, parameter in policy.named_parameters():  # adapters that change the output (PEFT zeroes B)
        if "lora_B" in name:
            parameter.data.normal_(0.0, 0.05)
    return policy


def prompts(model, rows: int = 4):
    vocab = min(model.lm_head_weight.shape[0], model.mask_token_id)
    ids = torch.randint(0, vocab, (rows, 6), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


def settings(model):
    from dllm_fast.rollout.config import GenerateConfig

    block = getattr(model.config, "block_size", 8)
    return GenerateConfig(gen_length=8, block_length=8 if block == 32 else block, steps=4, temperature=0.0,
                          cache="none")


class GatherCounter:
    """Counts FSDP2's all-gathers (torch.distributed.all_gather_single, all_gather_into_tensor)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        import torch.distributed as dist

        self.count, self.dist, self.saved = 0, dist, {}
        for name in self.NAMES:
            if hasattr(dist, name):
                original = getattr(dist, name)
                self.saved[name] = original
                setattr(dist, name, self._counting(original))

    def _counting(self, original):
        def call(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        return call

    def close(self):
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


def shard_all_but_experts(model):
    """FSDP2 on the layers and the root, the routed experts left out (whole on every rank): the layout the
    expert-parallel seam expects of a rank's own experts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    experts = {p for m in model.modules() if type(m).__name__ == "Experts" for p in m.parameters()}
    mesh = init_device_mesh("cpu", (WORLD,))
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh, ignored_params=experts)
    return fully_shard(model, mesh=mesh, ignored_params=experts)


CASES = (("llada", False), ("llada", True), ("llada2", False))  # full fine-tune, LoRA, the expert-parallel seam


def rollouts(rank: int, family: str, lora: bool) -> dict:
    """On this rank: the per-forward rollout's tokens and all-gathers, then each gathered copy's (LoRA: through the
    adapters and merged), the FSDP2 units, the denoising forwards, and what the copy shared and freed."""
    from dllm_fast.rollout import generate
    from dllm_fast.train.distributed import Ranks, data_parallel_wrapper
    from dllm_fast.train.rollout_weights import GatheredWeights, fsdp_units

    base = make_model(family)
    model = with_lora(base) if lora else base
    ids, mask = prompts(base)
    config = settings(base)
    if family == "llada2":  # its routed experts whole on every rank, outside FSDP2 (as expert parallelism's)
        wrapped = shard_all_but_experts(model)
    else:
        wrapped = data_parallel_wrapper(model, "fsdp2", Ranks(rank, WORLD), torch.device("cpu"))
    results = {"units": len(fsdp_units(wrapped))}
    counter = GatherCounter()
    try:
        with torch.no_grad():
            sharded = generate(wrapped, ids, mask, config, generator=torch.Generator().manual_seed(5))
            results["sharded"], results["forwards"] = (sharded.sequences, counter.count), int(sharded.nfe)
            for unit in fsdp_units(wrapped):  # FSDP2 keeps the root unsharded until a backward: as after one
                unit.reshard()
            for merge in ([False, True] if lora else [False]):
                counter.count = 0
                shared = (lambda m: type(m).__name__ == "Experts") if family == "llada2" else None
                copy = GatheredWeights(wrapped, merge_adapters=merge, shared=shared)
                sampler = copy.gather()
                gathered = generate(sampler, ids, mask, config, generator=torch.Generator().manual_seed(5))
                copy.release()
                results[f"gathered merge={merge}"] = (gathered.sequences, counter.count)
                if shared is not None:
                    experts = [m for m in sampler.modules() if type(m).__name__ == "Experts"]
                    results["experts shared"] = bool(experts) and all(
                        any(e is p for p in wrapped.modules()) for e in experts)
                results["released"] = copy.nbytes > 0 and all(
                    t.untyped_storage().size() == 0 for t in copy._sources.values())
    finally:
        counter.close()
    return results


def worker(rank, rendezvous, result_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        results = {case: rollouts(rank, *case) for case in CASES}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_distributed.worker: torch 2.13's gloo thread can abort a finalizing interpreter


@pytest.mark.slow
@pytest.mark.distributed
def test_gathered_copy_gives_the_per_forward_tokens_with_one_gather_a_unit(tmp_path):
    """T = 0: the same tokens on the copy as on FSDP2's per-forward gathers (full fine-tune; LoRA through the
    adapters and merged; LLaDA2 with its experts shared); the copy gathers each unit once a rollout, where the
    per-forward path gathers each layer unit at every forward; its storage is freed after; under the
    expert-parallel seam the copy calls the policy's own expert modules."""
    pytest.importorskip("peft")
    result = tmp_path / "rank0.pt"
    run_ranks(worker, (str(tmp_path / "rendezvous"), str(result)), WORLD)
    for case, out in torch.load(result, weights_only=False).items():
        sequences, per_forward = out["sharded"]
        # the layers' units at every forward; the root's once (FSDP2 keeps the root unsharded between forwards)
        assert per_forward == 1 + (out["units"] - 1) * out["forwards"] and out["forwards"] > 1, case
        copies = [name for name in out if name.startswith("gathered")]
        assert len(copies) == (2 if case[1] else 1), case
        for name in copies:
            tokens, gathers = out[name]
            assert torch.equal(tokens, sequences), (case, name)
            assert gathers == out["units"], (case, name)  # one all-gather a unit, for the whole rollout
        assert out["released"], case
        if case[0] == "llada2":
            assert out["experts shared"]


def test_rollout_path_rule_and_its_reasons():
    """auto: gathered within ROLLOUT_MARGIN of the memory (or with no limit known), sharded over it; an explicit
    choice is taken as given; a bad one names the flag."""
    capacity = 100 * 10**9
    assert rollout_path("auto", 10**9, int(ROLLOUT_MARGIN * capacity), capacity)[0] == "gathered"
    path, why = rollout_path("auto", 10**9, int(ROLLOUT_MARGIN * capacity) + 1, capacity)
    assert path == "sharded" and "would be" in why
    assert rollout_path("auto", 10**9, 10**15, None)[0] == "gathered"
    assert rollout_path("sharded", 1, 0, capacity) == ("sharded", "--rollout-weights sharded")
    with pytest.raises(ValueError, match="--rollout-weights 'once'"):
        rollout_path("once", 1, 0, capacity)


def test_keep_rule_is_measured():
    """Kept when the step's measured peak without the copy plus the copy stays within the margin; freed when it
    does not, or when nothing was measured."""
    capacity, copy = 100 * 10**9, 10 * 10**9
    assert keep_copy(int(ROLLOUT_MARGIN * capacity) - copy, copy, capacity)[0]
    assert not keep_copy(int(ROLLOUT_MARGIN * capacity) - copy + 1, copy, capacity)[0]
    assert keep_copy(None, copy, capacity) == (False, "no measured peak to keep it by")


def test_the_train_setting_is_checked():
    """--rollout-weights is a train setting (and a plan option through it): one of auto, gathered, sharded."""
    from dllm_fast.train.config import TrainConfig

    assert TrainConfig(rollout_weights="sharded").run.rollout_weights == "sharded"
    with pytest.raises(ValueError, match="--rollout-weights 'once' is not one of auto, gathered, sharded"):
        TrainConfig(rollout_weights="once")
