"""The rollout's decoding order from generate to TraceRL: RolloutBatch.unmask_step (checked, carried), and the
trainer and the TRL adapter asking generate to record it only for objectives that replay it. Until generate
records it itself, `generate_recording_unmask_step` (conftest) records it from outside the sampler."""

import math
import os

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import GenerationResult, RolloutBatch, completion_mask
from dllm_fast.likelihood import sample_masks
from dllm_fast.models import LLaDAConfig, LLaDAModel

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 126


def result_with_steps(steps, nfe=4, B=2, P=3, G=6):
    sequences = torch.randint(0, 100, (B, P + G), generator=torch.Generator().manual_seed(0))
    result = GenerationResult(sequences, sequences[:, P:], completion_mask(sequences[:, P:], EOS), nfe)
    result.unmask_step = steps  # the field generate fills with record_unmask_step=True
    return result


def test_rollout_batch_carries_and_checks_the_unmask_step():
    steps = torch.tensor([[0, 0, 1, 1, 2, 3], [3, 2, 1, 0, 0, 1]])
    batch = RolloutBatch.from_generation(result_with_steps(steps), [1.0, 0.0], group_size=1)
    assert torch.equal(batch.unmask_step, steps)
    assert torch.equal(batch.groups(1, 2).unmask_step, steps[1:]) and torch.equal(batch.to("cpu").unmask_step, steps)
    without = RolloutBatch.from_generation(GenerationResult(batch.sequences, batch.completion_ids,
                                                            batch.completion_mask, 4), [1.0, 0.0], group_size=1)
    assert without.unmask_step is None
    with pytest.raises(ValueError, match=r"unmask_step\[1, 0\] = 4 is not a denoising step in \[0, 4\) \(the rollout's forwards\)"):
        RolloutBatch.from_generation(result_with_steps(steps + (torch.arange(6) == 0) * torch.tensor([[0], [1]])),
                                     [1.0, 0.0], group_size=1)
    with pytest.raises(ValueError, match=r"unmask_step must be an int64 \[N, L\] = \[2, 6\] tensor"):
        RolloutBatch.from_generation(result_with_steps(steps.int()), [1.0, 0.0], group_size=1)
    with pytest.raises(ValueError, match=r"unmask_step\[0, 2\] = -1 is not a denoising step in \[0, 6\) \(the completion's positions"):
        bad = steps.clone()
        bad[0, 2] = -1
        RolloutBatch(batch.sequences, None, 3, batch.completion_mask, batch.rewards, 1, bad)
    with pytest.raises(ValueError, match=r"unmask_step must be an int64 \[N, L\] = \[2, 6\]"):
        RolloutBatch(batch.sequences, None, 3, batch.completion_mask, batch.rewards, 1, steps[:, :5])


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny"))


def test_recorded_order_replays_the_rollouts_states(generate_recording_unmask_step):
    """The trajectory sampler's state k is the canvas generate fed to its forward k: replaying the recorded order
    with shrink 1 gives exactly the masks of each denoising step."""
    model = tiny_model()
    prompts = torch.randint(0, 100, (3, 4), generator=torch.Generator().manual_seed(1))
    canvases = []
    original_forward = model.forward

    def recording_forward(input_ids, *args, **kwargs):
        canvases.append(input_ids.clone())
        return original_forward(input_ids, *args, **kwargs)

    model.forward = recording_forward
    result = generate_recording_unmask_step(model, prompts, gen_length=8, block_length=4, steps=4, temperature=1.0,
                                            generator=torch.Generator().manual_seed(0), record_unmask_step=True)
    masks = sample_masks(result.sequences, prompt_length=4, n_t=None, sampler="trajectory",
                         generator=torch.Generator(), eos_token_id=None, count="all",
                         unmask_step=result.unmask_step)
    assert masks.n_t == result.nfe == 4
    assert len(canvases) == 4
    for k, canvas in enumerate(canvases):
        assert torch.equal(masks.masked[:, k], canvas == model.mask_token_id)


@pytest.mark.slow
def test_the_trainer_replays_the_decoding_order_for_tracerl(tmp_path, monkeypatch, generate_recording_unmask_step):
    """The training rollouts' generate (train/step.py's) is asked for the order only by objectives that need it;
    TraceRL trains on it without NaN."""
    from dllm_fast.train import TrainConfig, train
    from dllm_fast.train import step as step_module

    asked = []

    def generate(*args, record_unmask_step=False, **kwargs):
        asked.append(record_unmask_step)
        return generate_recording_unmask_step(*args, record_unmask_step=record_unmask_step, **kwargs)

    monkeypatch.setattr(step_module, "generate", generate)
    drawn = []
    original = objectives.TraceRL.draw_masks

    def draw_masks(self, batch, **kwargs):
        masks = original(self, batch, **kwargs)
        drawn.append((batch.unmask_step, masks))
        return masks

    monkeypatch.setattr(objectives.TraceRL, "draw_masks", draw_masks)
    config = TrainConfig(objective="tracerl", steps=2, prompts_per_step=2, group_size=4, inner_updates=2,
                         eval_every=10, checkpoint_every=10, eval_examples=4, progress=False, plot=False, threads=1,
                         output_dir=str(tmp_path / "run"))
    result = train(config)
    rows = [row for row in result.history if "loss" in row]
    assert len(rows) == 2 and all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    assert all(0 < row["states_per_sequence"] <= 2 for row in rows)  # 12 forwards in states of 8
    assert asked and all(asked[:2])  # the training rollouts recorded; evaluation's greedy ones need not
    steps, masks = drawn[0]
    assert steps is not None and steps.max() < 12 and masks.sampler == "trajectory"
    asked.clear()
    train(config.replace(objective="espo", steps=1, inner_updates=1, output_dir=str(tmp_path / "espo")))
    assert asked and not any(asked)  # no other objective pays for the record


def test_the_trl_adapter_replays_the_decoding_order_for_tracerl(tmp_path, monkeypatch,
                                                                  generate_recording_unmask_step):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from dllm_fast.integrations import trl as adapter
    from dllm_fast.integrations import trl_example
    from dllm_fast.train import step as step_module

    monkeypatch.setattr(step_module, "generate", generate_recording_unmask_step)
    trainer = trl_example.build_trainer(str(tmp_path), objective="tracerl", steps=2)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
    assert all(row["objective/states_per_sequence"] > 0 for row in rows)
    assert trainer._unmask_step is not None
    # rollout_batch cuts the record to TRL's completion width
    generated = {"prompt_ids": torch.zeros(2, 3, dtype=torch.long), "prompt_mask": torch.ones(2, 3, dtype=torch.long),
                 "completion_ids": torch.tensor([[5, EOS], [6, 7]]), "completion_mask": torch.tensor([[1, 1], [1, 1]])}
    batch = adapter.rollout_batch(generated, torch.tensor([1.0, 0.0]), 2, EOS,
                                  unmask_step=torch.tensor([[0, 1, 1, 2], [1, 0, 2, 2]]))
    assert batch.unmask_step.tolist() == [[0, 1], [1, 0]]
    with pytest.raises(RuntimeError, match=r"does not cover this generation batch's completions \(2, 2\)"):
        adapter.rollout_batch(generated, torch.tensor([1.0, 0.0]), 2, EOS, unmask_step=torch.zeros(2, 1).long())


def test_generates_own_record_matches_the_outside_one(generate_recording_unmask_step):
    """Once generate records the order itself (record_unmask_step=True), it is the one TraceRL was tested on here."""
    import inspect

    import dllm_fast

    if "record_unmask_step" not in inspect.signature(dllm_fast.generate).parameters:
        pytest.skip("this build's generate does not record the unmask step")
    model = tiny_model()
    prompts = torch.randint(0, 100, (3, 4), generator=torch.Generator().manual_seed(1))
    options = dict(gen_length=8, block_length=4, steps=4, temperature=1.0, record_unmask_step=True)
    own = dllm_fast.generate(model, prompts, generator=torch.Generator().manual_seed(0), **options)
    outside = generate_recording_unmask_step(model, prompts, generator=torch.Generator().manual_seed(0), **options)
    assert torch.equal(own.sequences, outside.sequences) and torch.equal(own.unmask_step, outside.unmask_step)


def test_the_trl_record_cut_to_the_completion_width_keeps_the_rollouts_bound():
    """TRL's completions can be narrower than the rollout: the cut record keeps steps up to the rollout's own
    gen_length, which bounds its forwards (issue 32 item 5), and steps beyond it are refused."""
    pytest.importorskip("trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from dllm_fast.integrations import trl as adapter

    generated = {"prompt_ids": torch.zeros(2, 3, dtype=torch.long), "prompt_mask": torch.ones(2, 3, dtype=torch.long),
                 "completion_ids": torch.tensor([[5, EOS], [6, 7]]), "completion_mask": torch.tensor([[1, 1], [1, 1]])}
    batch = adapter.rollout_batch(generated, torch.tensor([1.0, 0.0]), 2, EOS,
                                  unmask_step=torch.tensor([[3, 1, 0, 2], [2, 3, 0, 1]]))
    assert batch.unmask_step.tolist() == [[3, 1], [2, 3]] and batch.forwards == 4
    with pytest.raises(ValueError, match=r"unmask_step\[0, 0\] = 9 is not a denoising step in \[0, 4\)"):
        adapter.rollout_batch(generated, torch.tensor([1.0, 0.0]), 2, EOS,
                              unmask_step=torch.tensor([[9, 1, 0, 2], [2, 3, 0, 1]]))
