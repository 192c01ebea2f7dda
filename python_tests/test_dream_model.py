"""The native Dream family (issue 40 item 13): Dream-7B's shapes as a preset for `plan` and for `train` with random
weights. Its forward is Qwen2's layers run bidirectionally (checked against transformers' Qwen2 with a full
attention mask), its hidden state at i predicts token i + 1, its checkpoints round-trip, and the caches that read
a block's own positions are refused by name."""

import json

import pytest
import torch

import dllm_fast
from dllm_fast.models import DreamConfig, DreamModel
from dllm_fast.reference import generate as reference_generate
from dllm_fast.models.loading import FAMILIES, PRESETS, model_family
from dllm_fast.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_dream_7b_preset_has_dream_7bs_shapes():
    """Dream-v0-Instruct-7B's config.json: Qwen2.5-7B's shapes (7.62B parameters), mask 151666."""
    config = DreamConfig.preset("dream-7b")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (3584, 18944, 28, 28, 4, 128, 152064)
    assert (config.mask_token_id, config.eos_token_id, config.rope_theta, config.tie_word_embeddings) == (
        151666, 151643, 1e6, False)
    with torch.device("meta"):
        model = DreamModel(config)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512
    assert model.logit_shift == 1 and PRESETS["dream-7b"][0] is DreamModel and FAMILIES["Dream"] is DreamModel


def test_the_forward_is_qwen2_run_bidirectionally():
    transformers = pytest.importorskip("transformers")
    model = DreamModel.with_random_weights(DreamConfig.preset("dream-tiny"), dtype=torch.float64, seed=3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    c = model.config
    qwen = transformers.Qwen2Model(transformers.Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        attn_implementation="eager")).double()
    qwen.load_state_dict({k.removeprefix("model."): v for k, v in model.state_dict().items() if k.startswith("model.")})
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    every_key = torch.zeros(2, 1, 9, 9, dtype=torch.float64)  # additive: nothing masked (bidirectional)
    with torch.no_grad():
        ours, theirs = model(ids), qwen(ids, attention_mask=every_key).last_hidden_state
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # transformers' rotary tables are fp32
        assert (ours - qwen(ids).last_hidden_state).abs().max() > 1e-2  # not causal
        # Left padding: positions count from the first real token, padded keys are never read.
        padded = torch.cat([torch.full((2, 3), 126), ids], dim=1)
        mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 9, dtype=torch.long)], dim=1)
        torch.testing.assert_close(model(padded, mask)[:, 3:], ours, rtol=1e-10, atol=1e-10)


def test_generate_reads_token_i_from_position_i_minus_1_and_refuses_the_caches():
    model = DreamModel.with_random_weights(DreamConfig.preset("dream-tiny"), seed=1).eval()
    ids = torch.randint(0, 120, (2, 6), generator=torch.Generator().manual_seed(1))
    out = dllm_fast.generate(model, ids, gen_length=8, block_length=4, steps=8)
    assert (out.completion_ids != model.mask_token_id).all()
    reference = reference_generate(model, ids, gen_length=8, block_length=4, steps=8)
    assert torch.equal(out.sequences, reference.sequences)
    for cache in ("prefix", "dual"):
        with pytest.raises(ValueError, match=rf"cache='{cache}' needs a model with logit_shift=0"):
            dllm_fast.generate(model, ids, gen_length=8, block_length=4, steps=8, cache=cache)


def test_a_checkpoint_round_trips(tmp_path):
    model = DreamModel.with_random_weights(DreamConfig.preset("dream-tiny"), seed=2)
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "Dream" and written["architectures"] == ["DreamModel"]
    assert model_family(tmp_path) is DreamModel
    loaded = DreamModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    written["rope_scaling"] = {"type": "yarn"}
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=r"rope_scaling=.* is not supported by dllm_fast's Dream"):
        DreamModel.from_pretrained(tmp_path)


def test_train_runs_the_dream_preset_with_random_weights(tmp_path):
    result = train(TrainConfig(model="dream-tiny", task="synthetic", steps=1, prompts_per_step=2, group_size=2,
                               task_options={"prompt_length": 8, "num_train": 8, "num_test": 2}, eval_examples=2,
                               gen_length=8, block_length=8, diffusion_steps=4, eval_gen_lengths=[8],
                               progress=False, plot=False, threads=1, output_dir=str(tmp_path / "run")))
    assert result.steps == 1
    with pytest.raises(ValueError, match=r"--cache dual needs a model that predicts each position from itself; "
                                         r"--model 'dream-7b' \(DreamModel\)"):
        TrainConfig(model="dream-7b", cache="dual")


@pytest.mark.slow
def test_plan_plans_dream_7b(capsys):
    """`plan --model dream-7b`: Dream-7B's weights (15.2 GB in bf16) under LoRA, on fake tensors (about 20 s)."""
    from dllm_fast.planning import cli

    cli.main(["--model", "dream-7b", "--lora", "true", "--prompt-length", "8", "--gen-length", "16",
              "--block-length", "8", "--diffusion-steps", "4", "--prompts-per-step", "1", "--group-size", "2",
              "--micro-batch", "4", "--gpu", "h100", "--search", "false", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["rollout_nfe"] == 4
    assert 15.0e9 < plan["weight_bytes_per_forward"] < 15.5e9  # 7.62B parameters in bf16, the embedding gathered
