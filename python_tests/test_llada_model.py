"""The native LLaDA model: official checkpoint layout in and out, and logits equal to a plain recomputation."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from dllm_fast.models import LLaDAConfig, LLaDAModel

P = "model.transformer."

# config.json as the official LLaDA-8B-Instruct ships it, scaled down to a tiny body with GQA (2 kv heads).
OFFICIAL_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 32,
    "embedding_dropout": 0.0, "embedding_size": 100, "eos_token_id": 94, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 95, "max_sequence_length": 128, "mlp_hidden_size": 48,
    "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 2,
    "n_layers": 2, "pad_token_id": 94, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
    "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 96, "weight_tying": False,
}


def official_weights(config, generator):
    """A state dict under the official key names, written without touching dllm_fast's module code."""
    d, hidden, emb = config["d_model"], config["mlp_hidden_size"], config["embedding_size"]
    kv = config["n_kv_heads"] * d // config["n_heads"]

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    weights = {P + "wte.weight": rand(emb, d), P + "ln_f.weight": 1 + 0.1 * rand(d),
               P + "ff_out.weight": rand(emb, d, scale=2 / math.sqrt(d))}
    for i in range(config["n_layers"]):
        b = f"{P}blocks.{i}."
        weights.update({
            b + "attn_norm.weight": 1 + 0.1 * rand(d), b + "ff_norm.weight": 1 + 0.1 * rand(d),
            b + "q_proj.weight": rand(d, d, scale=d**-0.5), b + "k_proj.weight": rand(kv, d, scale=d**-0.5),
            b + "v_proj.weight": rand(kv, d, scale=d**-0.5), b + "attn_out.weight": rand(d, d, scale=d**-0.5),
            b + "ff_proj.weight": rand(hidden, d, scale=d**-0.5), b + "up_proj.weight": rand(hidden, d, scale=d**-0.5),
            b + "ff_out.weight": rand(d, hidden, scale=hidden**-0.5),
        })
    return weights


def recompute_logits(w, config, ids, attention_mask=None):
    """The LLaDA architecture written out in float64, straight from the official weight names."""
    w = {k: v.double() for k, v in w.items()}
    H, Hkv = config["n_heads"], config["n_kv_heads"]
    D = config["d_model"] // H
    B, L = ids.shape

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config["rms_norm_eps"])

    inv_freq = config["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq  # [L, D/2]
    cos, sin = angle.cos(), angle.sin()

    def rope(x):  # x [B, heads, L, D]: rotate the pair (x_j, x_{j+D/2}) by angle_j
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    bias = torch.zeros(B, 1, 1, L, dtype=torch.float64)
    if attention_mask is not None:
        bias = bias.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
    x = w[P + "wte.weight"][ids]
    for i in range(config["n_layers"]):
        b = f"{P}blocks.{i}."
        n = rms(x, w[b + "attn_norm.weight"])
        q = (n @ w[b + "q_proj.weight"].T).view(B, L, H, D).transpose(1, 2)
        k = (n @ w[b + "k_proj.weight"].T).view(B, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        v = (n @ w[b + "v_proj.weight"].T).view(B, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
        scores = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(D) + bias  # no causal mask
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, H * D)
        h = x + att @ w[b + "attn_out.weight"].T
        m = rms(h, w[b + "ff_norm.weight"])
        gate, up = m @ w[b + "ff_proj.weight"].T, m @ w[b + "up_proj.weight"].T
        x = h + (gate * torch.sigmoid(gate) * up) @ w[b + "ff_out.weight"].T
    return rms(x, w[P + "ln_f.weight"]) @ w[P + "ff_out.weight"].T


def write_official_checkpoint(directory, config, weights, shards=1):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    keys = sorted(weights)
    if shards == 1:
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[s::shards]}
        save_file(part, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def official(tmp_path):
    weights = official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(1))
    return weights, tmp_path / "llada-tiny"


@pytest.mark.parametrize("shards", [1, 3])
def test_official_checkpoint_logits_match_recomputation(official, shards):
    weights, directory = official
    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights, shards=shards)
    ids = torch.randint(0, 90, (2, 11))

    model = LLaDAModel.from_pretrained(directory, dtype=torch.float64)
    expected = recompute_logits(weights, OFFICIAL_CONFIG, ids)
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model(ids) @ model.lm_head_weight.T, expected, rtol=1e-10, atol=1e-10)

    fp32 = LLaDAModel.from_pretrained(directory)
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32.logits(ids).double(), expected, rtol=1e-4, atol=1e-4)


def test_padding_mask_matches_recomputation(official):
    weights, directory = official
    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights)
    model = LLaDAModel.from_pretrained(directory, dtype=torch.float64)
    ids = torch.randint(0, 90, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    expected = recompute_logits(weights, OFFICIAL_CONFIG, ids, mask)
    torch.testing.assert_close(model.logits(ids, attention_mask=mask), expected, rtol=1e-10, atol=1e-10)


def test_left_padding_leaves_real_tokens_unchanged():
    """RoPE is relative and padded keys are masked, so a left-padded row equals the unpadded sequence."""
    model = LLaDAModel(LLaDAConfig.preset("tiny")).double()
    ids = torch.randint(0, 120, (1, 7))
    padded = torch.cat([torch.full((1, 4), model.config.pad_token_id), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded, attention_mask=mask)[:, 4:], model(ids), rtol=1e-10, atol=1e-10)
    shifted = torch.arange(7)[None] + 13
    torch.testing.assert_close(model(ids, position_ids=shifted), model(ids), rtol=1e-10, atol=1e-10)


def test_save_pretrained_writes_the_official_layout(official, tmp_path):
    weights, directory = official
    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights)
    model = LLaDAModel.from_pretrained(directory)

    out = tmp_path / "resaved"
    model.save_pretrained(out, max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((out / "config.json").read_text())
    for key, value in OFFICIAL_CONFIG.items():  # every official field survives, auto_map included
        assert config[key] == value, key

    again = LLaDAModel.from_pretrained(out)
    ids = torch.randint(0, 90, (1, 6))
    assert torch.equal(again.logits(ids), model.logits(ids))

    model.save_pretrained(out)  # now small enough for one file: stale shards and index are removed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(LLaDAModel.from_pretrained(out).logits(ids), model.logits(ids))


def word_level_tokenizer(size):
    """A fast tokenizer over words w0..w{size-4} plus LLaDA's three special tokens as the last ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|eot_id|>", "<|endoftext|>", "<|mdm_mask|>"]
    words = size - len(specials)
    vocab = {f"w{i}": i for i in range(words)} | {tok: words + i for i, tok in enumerate(specials)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|mdm_mask|>"
    )


def test_tokenizer_loads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    model.save_pretrained(tmp_path, tokenizer=word_level_tokenizer(128))

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("w3 w5 <|eot_id|>").input_ids == [3, 5, 125]
    assert loaded.mask_token_id == model.mask_token_id == 127
    assert loaded.eos_token_id == model.eos_token_id == 126


def test_load_then_save_carries_the_tokenizer_and_remote_code(official, tmp_path):
    """An official directory (auto_map config, tokenizer, modeling files) survives from_pretrained + save_pretrained."""
    from transformers import AutoTokenizer

    weights, directory = official
    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights)
    word_level_tokenizer(96).save_pretrained(directory)
    (directory / "configuration_llada.py").write_text("# the official remote-code config class\n")

    out = tmp_path / "resaved"
    LLaDAModel.from_pretrained(directory).save_pretrained(out)
    assert (out / "configuration_llada.py").read_text() == (directory / "configuration_llada.py").read_text()
    assert json.loads((out / "config.json").read_text())["auto_map"] == OFFICIAL_CONFIG["auto_map"]
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded("w3 <|eot_id|>").input_ids == [3, 93]
    assert (loaded.mask_token_id, loaded.eos_token_id) == (OFFICIAL_CONFIG["mask_token_id"], OFFICIAL_CONFIG["eos_token_id"])


def test_load_arguments_are_checked(official):
    weights, directory = official
    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights)
    assert LLaDAModel.from_pretrained(directory, dtype="bfloat16").dtype == torch.bfloat16
    assert LLaDAModel.from_pretrained(directory, dtype=torch.float16, device="cpu").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype='bfloat' names no torch dtype"):
        LLaDAModel.from_pretrained(directory, dtype="bfloat")
    with pytest.raises(ValueError, match="dtype=torch.int64 is not a floating-point torch dtype"):
        LLaDAModel.from_pretrained(directory, dtype=torch.int64)
    with pytest.raises(ValueError, match="device='gpu' is not a torch device"):
        LLaDAModel.from_pretrained(directory, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda', but this torch has no usable CUDA device"):
            LLaDAModel.from_pretrained(directory, device="cuda")


def test_bad_token_ids_are_named():
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got torch.float32"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"token id 128, outside the model's embedding table \[0, 128\)"):
        model(torch.tensor([[1, 128]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 3]]))


def test_corrupt_or_incomplete_checkpoints_are_named(official):
    weights, directory = official
    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights, shards=2)
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors is not a readable safetensors file"):
        LLaDAModel.from_pretrained(directory)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is listed"):
        LLaDAModel.from_pretrained(directory)

    write_official_checkpoint(directory, OFFICIAL_CONFIG, weights, shards=2)
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    moved = next(k for k, f in index["weight_map"].items() if f.startswith("model-00002"))
    index["weight_map"][moved] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"lists '{moved}' .* in .*model-00001-of-00002.safetensors, which lacks it"):
        LLaDAModel.from_pretrained(directory)

    missing = dict(weights)
    del missing[P + "blocks.1.up_proj.weight"]
    write_official_checkpoint(directory, OFFICIAL_CONFIG, missing)
    (directory / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="lacks 1 weights .* model.transformer.blocks.1.up_proj.weight"):
        LLaDAModel.from_pretrained(directory)

    wrong = dict(weights)
    wrong[P + "ln_f.weight"] = torch.ones(7)
    write_official_checkpoint(directory, OFFICIAL_CONFIG, wrong)
    with pytest.raises(ValueError, match=r"ln_f.weight .* has shape \(7,\); the config requires \(32,\)"):
        LLaDAModel.from_pretrained(directory)

    (directory / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LLaDAModel.from_pretrained(directory)


@pytest.mark.parametrize(
    "field, value", [("block_type", "sequential"), ("include_bias", True), ("residual_dropout", 0.1),
                     ("rope", False), ("activation_type", "gelu")]
)
def test_unsupported_architecture_is_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field}="):
        LLaDAConfig.from_dict({**OFFICIAL_CONFIG, field: value})


def test_presets_and_config_checks():
    big = LLaDAConfig.preset("llada-8b")
    assert (big.d_model, big.n_layers, big.vocab_size, big.mask_token_id, big.eot_token_id) == (
        4096, 32, 126464, 126336, 126348)
    assert LLaDAConfig.preset("small").vocab_size == 126464
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        LLaDAConfig.preset("huge")
    with pytest.raises(ValueError, match="mask_token_id=500 is outside the vocabulary"):
        LLaDAConfig(vocab_size=100, mask_token_id=500)
    assert LLaDAConfig.from_dict(OFFICIAL_CONFIG).eot_token_id is None  # not LLaDA's tokenizer: unknown


def test_weight_tying_uses_the_embedding_as_head():
    config = LLaDAConfig(**{**LLaDAConfig.preset("tiny").__dict__, "weight_tying": True})
    model = LLaDAModel(config)
    assert model.lm_head_weight is model.transformer["wte"].weight
    assert "ff_out" not in model.transformer


def test_gradient_checkpointing_gives_the_same_gradients():
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    ids = torch.randint(0, 120, (2, 8))
    plain = torch.autograd.grad(model.logits(ids).square().mean(), list(model.parameters()))
    model.set_gradient_checkpointing(True)
    checkpointed = torch.autograd.grad(model.logits(ids).square().mean(), list(model.parameters()))
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b)


def test_bf16_forward_keeps_rope_in_fp32():
    """A bf16 model is as close to its fp32 twin at position 3000 as at position 0. Were RoPE's angles formed in
    bf16 (8 mantissa bits: errors of several radians at position 3000), the far positions would be garbage."""
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    ids = torch.randint(0, 120, (2, 8))
    near, far = torch.arange(8)[None].expand(2, 8), torch.arange(8)[None].expand(2, 8) + 3000
    reference = {name: model.logits(ids, position_ids=pos) for name, pos in (("near", near), ("far", far))}
    model.to(torch.bfloat16)
    errors = {}
    for name, pos in (("near", near), ("far", far)):
        low = model.logits(ids, position_ids=pos)
        assert low.dtype == torch.bfloat16
        errors[name] = (low.float() - reference[name]).abs().max().item()
    assert errors["near"] < 0.15 and errors["far"] < 2 * errors["near"] + 0.02, errors


# 3 layers: a residual scale 1/sqrt(6) that bf16 cannot hold exactly, so rounding twice would show.
@pytest.mark.parametrize("n_layers", [2, 3])
def test_with_random_weights_is_seeded_and_built_in_place(n_layers):
    config = dataclasses.replace(LLaDAConfig.preset("tiny"), n_layers=n_layers)
    model = LLaDAModel.with_random_weights(config, dtype=torch.bfloat16, seed=3)
    assert model.dtype == torch.bfloat16 and not any(p.is_meta for p in model.parameters())
    again = LLaDAModel(config)
    again.init_weights(generator=torch.Generator().manual_seed(3))
    for a, b in zip(model.parameters(), again.to(torch.bfloat16).parameters()):
        assert torch.equal(a, b)
    other = LLaDAModel.with_random_weights(config, dtype=torch.bfloat16, seed=4)
    assert not torch.equal(other.lm_head_weight, model.lm_head_weight)


def test_with_random_weights_on_meta_names_the_skeleton_recipe():
    """Meta tensors hold no values to draw: one sentence with the way to a skeleton, not torch's "META device
    type not an accelerator"."""
    with pytest.raises(ValueError, match=r"with_random_weights\(device='meta'\).*with torch.device\('meta'\)"):
        LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), device="meta")
