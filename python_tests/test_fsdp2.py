"""The trainer under `--parallel fsdp2` (issue 46 item 1): the mixed precision it shards with, LoRA (the frozen base
sharded with the adapters), the reference copy sharded like the policy, and micro-batches that reduce-scatter at
every backward. The distributed runs are gloo ranks on CPU in fp64, each rank updating on its share of the prompt
groups, against one process updating on the whole batch: the parameters after two optimizer steps agree to 1e-10."""

import os
import sys
from datetime import timedelta

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.testing.ranks import run_ranks
from dllm_fast.train import TrainConfig
from dllm_fast.train.precision import Precision, sharded_mixed_precision, training_precision

pytestmark = pytest.mark.usefixtures("one_thread")

G, P, L = 2, 6, 8  # group size, prompt and completion lengths of the made-up rollouts
FP64 = Precision(None, torch.float64, torch.float64)


def test_fsdp2_gathers_in_bf16_and_reduces_in_fp32_on_cuda_only():
    """One place decides FSDP2's MixedPrecisionPolicy: on CUDA with bf16 compute, weights gathered in bf16 and
    gradients reduced in fp32; on CPU, or without bf16 compute, none (each weight in its own dtype)."""
    cuda = sharded_mixed_precision(training_precision(TrainConfig(), "cuda"), "cuda")
    assert (cuda.param_dtype, cuda.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert sharded_mixed_precision(training_precision(TrainConfig(), "cpu"), "cpu") is None
    assert sharded_mixed_precision(training_precision(TrainConfig(bf16=True), "cpu"), "cpu") is None
    assert sharded_mixed_precision(training_precision(TrainConfig(bf16=False), "cuda"), "cuda") is None
    assert sharded_mixed_precision(FP64, "cpu") is None


def test_every_fsdp2_unit_is_sharded_with_the_runs_policy(monkeypatch):
    """data_parallel_wrapper hands the policy to each of the model's units and to the root (fully_shard stood in
    for: no process group needed)."""
    import torch.distributed.device_mesh
    import torch.distributed.fsdp

    from dllm_fast.models import LLaDAConfig, LLaDAModel
    from dllm_fast.train.distributed import Ranks, data_parallel_wrapper

    sharded = []
    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh", lambda device, shape: ("mesh", shape))
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard",
                        lambda module, *, mesh, mp_policy, offload_policy: sharded.append((module, mesh, mp_policy))
                        or module)
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    policy = sharded_mixed_precision(training_precision(TrainConfig(), "cuda"), "cuda")
    assert data_parallel_wrapper(model, "fsdp2", Ranks(0, 2), torch.device("cpu"), mixed_precision=policy) is model
    assert [m for m, _, _ in sharded] == [*model.shard_units(), model]
    assert all(mesh == ("mesh", (2,)) and mp is policy for _, mesh, mp in sharded)


def test_an_fsdp2_module_reduce_scatters_at_every_backward():
    """The engine never turns FSDP2's gradient sync off between micro-batches (set_requires_gradient_sync(False)
    would accumulate whole gradients on every rank); each backward reduce-scatters into the shards instead."""
    from dllm_fast.likelihood import sample_masks, streaming_backward
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    class LooksSharded(LLaDAModel):  # what the engine sees of an FSDP2 module: set_requires_gradient_sync
        switched = []

        def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
            self.switched.append(requires_gradient_sync)

    torch.manual_seed(0)
    model = LooksSharded(LLaDAConfig.preset("tiny"))
    sequences = torch.randint(0, 100, (2, P + L))
    masks = sample_masks(sequences, prompt_length=P, n_t=4, sampler="stratified_l", eos_token_id=model.eos_token_id,
                         generator=torch.Generator().manual_seed(1))
    streaming_backward(model, sequences, masks, lambda lp: -lp.sum(), micro_batch=3)  # 8 pairs: 3 backwards
    assert LooksSharded.switched == []
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_merged_lora_rollouts_need_the_gathered_copy_under_fsdp2(tmp_path):
    """--lora-merge-rollouts merges into the copy gathered once a step; --rollout-weights sharded has none, so the
    pair is refused before anything is written (no process group needed: RunSetup refuses first)."""
    from dllm_fast.train.distributed import Ranks
    from dllm_fast.train.run import RunSetup
    from dllm_fast.train.run_dir import RunDirectory

    config = TrainConfig(output_dir=str(tmp_path / "run"), parallel="fsdp2", lora=True, lora_merge_rollouts=True,
                         rollout_weights="sharded", prompts_per_step=2)
    ranks = Ranks(0, 2)
    with pytest.raises(ValueError, match="--lora-merge-rollouts true under --parallel fsdp2 merges the adapters"):
        RunSetup(config, ranks, RunDirectory(config.run.output_dir, ranks))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------
# Gloo ranks


def run_config(output_dir, lora: bool, groups: int) -> TrainConfig:
    """Two steps of ESPO with a KL term (beta > 0: a reference policy), 2 pairs a micro-batch (several backwards
    an update), `groups` prompt groups a step, on the embedded default model (the made-up batches are its
    rollouts; the synthetic task's 8 short prompts make a quick setup: the default task's thousands of prompts are
    each tokenized at every run's setup); LoRA of rank 3, whose A matrices FSDP2 shards unevenly (over 4 ranks one
    rank holds none of their rows)."""
    return TrainConfig(output_dir=str(output_dir), objective="espo", objective_options={"n_t": 4, "beta": 0.05},
                       task="synthetic", task_options={"prompt_length": P, "num_train": 8, "num_test": 1},
                       micro_batch=2, prompts_per_step=groups, group_size=G, steps=2, parallel="fsdp2",
                       lora=lora, lora_rank=3, lr=1e-2, device="cpu", threads=1, progress=False, plot=False,
                       eval_every=100, checkpoint_every=100, eval_examples=1)


def made_up_batch(step: int, groups: int, vocabulary: int, eos: int) -> RolloutBatch:
    """The same rollouts on every rank (each takes its share): random prompts and completions, some cut by EOS."""
    gen = torch.Generator().manual_seed(100 + step)
    sequences = torch.randint(0, vocabulary, (groups * G, P + L), generator=gen)
    sequences[1, P + 5:] = eos
    rewards = torch.rand(groups * G, generator=gen, dtype=torch.float64).round(decimals=1)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], eos), rewards, G)


def two_steps(config: TrainConfig, ranks) -> dict:
    """The trainer's Run of `config` in fp64 on `ranks`, two updates on the made-up batches (this rank's share):
    (whole trainable weights by name, reduce-scatters counted, whether the reference is sharded)."""
    from dllm_fast.train.run import Run, RunSetup
    from dllm_fast.train.run_dir import RunDirectory

    run_dir = RunDirectory(config.run.output_dir, ranks)
    setup = RunSetup(config, ranks, run_dir)
    setup.precision = FP64  # the exact comparison: every weight in fp64
    run = Run(config, ranks, run_dir, setup=setup)
    reduce_scatters = []
    if ranks.world > 1:
        original = torch.distributed.reduce_scatter_single  # FSDP2's reduce-scatter of a unit's gradients

        def counted(*args, **kwargs):
            reduce_scatters.append(1)
            return original(*args, **kwargs)

        torch.distributed.reduce_scatter_single = counted
    eos = run.core.eos_token_id
    initial = {name: p.detach().clone() for name, p in run.core.named_parameters() if p.requires_grad} \
        if ranks.world == 1 else None  # what the steps start from (one process's weights are whole)
    for step in range(2):
        batch = made_up_batch(step, config.run.prompts_per_step, 100, eos)
        # the masks of the whole batch, drawn once: each rank takes the rows of its groups
        masks = run.objective.draw_masks(batch, generator=torch.Generator().manual_seed(7 + step), eos_token_id=eos)
        groups = run.share  # this rank's prompts, each a group of G rows
        mine = batch.groups(groups.start, groups.stop)
        run.update(mine, objectives.InnerUpdate(masks.rows(groups.start * G, groups.stop * G)))
        run.step += 1
    weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for name, p in run.core.named_parameters() if p.requires_grad}
    sharded_reference = run.ref_model is not None and any(hasattr(p, "full_tensor")
                                                          for p in run.ref_model.parameters())
    from dllm_fast.train.rollout_weights import fsdp_units

    def trains(unit) -> bool:  # the unit's own parameters (FSDP2's group of it) include one with a gradient
        group = unit._get_fsdp_state()._fsdp_param_group
        return group is not None and any(p.sharded_param.requires_grad for p in group.fsdp_params)

    units = [u for u in fsdp_units(run.model) if trains(u)]
    return {"weights": weights, "initial": initial, "reduce_scatters": len(reduce_scatters),
            "sharded_reference": sharded_reference,
            "reference": run.ref_model is not None, "units_with_gradients": len(units), "notes": run.setup_notes}


LAUNCHES = {2: (False, True), 4: (True,)}  # the LoRA settings each world size's one launch runs


def worker(rank, world, rendezvous, output_dir, result_path):
    """Every case of LAUNCHES[world] in one process group (one launch a world size: CI's time); rank 0 saves
    {lora: result}."""
    import torch.distributed as dist

    from dllm_fast.train.distributed import Ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a lost peer fails the collective, never hangs it
    try:
        result = {lora: two_steps(run_config(f"{output_dir}-{lora}", lora, groups=world), Ranks(rank, world))
                  for lora in LAUNCHES[world]}
        if rank == 0:
            torch.save(result, result_path)
    finally:
        dist.destroy_process_group()
    # As in test_distributed: torch 2.13's gloo worker thread can abort a finalizing interpreter; the result is saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """{world: rank 0's {lora: two_steps result}}, from one launch of gloo ranks per world size."""
    results = {}
    for world in LAUNCHES:
        root = tmp_path_factory.mktemp(f"fsdp2_world{world}")
        result = root / "rank0.pt"
        run_ranks(worker, (world, str(root / "rendezvous"), str(root / "ranks"), str(result)), world,
                  timeout_s=240 * world)  # a loaded 2-core runner: about 3 minutes for 2 ranks
        results[world] = torch.load(result)
    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world, lora", [(2, False), (2, True), (4, True)], ids=["full-2", "lora-2", "lora-4"])
def test_fsdp2_ranks_equal_one_process_after_two_steps(launches, tmp_path, world, lora):
    """2 or 4 gloo ranks under FSDP2, full fine-tune (the reference a sharded frozen copy) and LoRA (the frozen base
    sharded, the reference the adapter-disabled policy): after two AdamW steps of 4 micro-batches an update (a group a rank), the
    trained weights equal one process's on the whole batch to 1e-10, and each micro-batch's backward
    reduce-scattered (more reduce-scatters than the units with gradients: never one accumulated whole)."""
    distributed = launches[world][lora]
    single = two_steps(run_config(tmp_path / "single", lora, groups=world), _one_process())
    assert distributed["reference"] == (not lora) and distributed["sharded_reference"] == (not lora)
    sharded = "the frozen base with its LoRA adapters" if lora else "the policy and the reference copy"
    assert f"--parallel fsdp2: {sharded} sharded over {world} ranks, gathered in each weight's own dtype" in \
        distributed["notes"]
    # Once a unit an update would be the no_sync count; a rank's 8 pairs (its group's 2 sequences x n_t 4) in
    # micro-batches of 2 make several backwards an update
    assert distributed["reduce_scatters"] >= 2 * 2 * distributed["units_with_gradients"] > 0
    assert distributed["weights"].keys() == single["weights"].keys()
    initial = single["initial"]
    moved = 0
    for name, want in single["weights"].items():
        torch.testing.assert_close(distributed["weights"][name], want, rtol=1e-10, atol=1e-12, msg=name)
        moved += int(not torch.equal(want, initial[name]))
    assert moved > len(single["weights"]) // 2  # the steps really changed the weights


def _one_process():
    from dllm_fast.train.distributed import Ranks

    return Ranks()
