"""The native SDAR model: its forward against the plain fp64 twin written from the equations (reference/sdar.py)
and against transformers' Qwen3 given the same mask, the block-causal mask against a dense one built pair by pair,
its cached and two-stream layouts, and the official checkpoint layout (keys, config.json, shards, ties, checks)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm_fast.contracts import block_length
from dllm_fast.models import SDARConfig, SDARModel
from dllm_fast.models.block_attention import block_causal, first_token, two_stream
from dllm_fast.models.loading import PRESETS, load_model, model_class
from dllm_fast.reference import sdar as reference

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(dtype=torch.float64, seed=1, **overrides):
    config = SDARConfig(**{**SDARConfig.preset("sdar-tiny").__dict__, "extra": {}, **overrides})
    return SDARModel.with_random_weights(config, dtype=dtype, seed=seed)


def left_padded(B=3, S=13, seed=0, pad=(0, 2, 5)):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 120, (B, S), generator=generator)
    mask = torch.ones_like(ids)
    for n, count in enumerate(pad[:B]):
        mask[n, :count] = 0
    return ids.masked_fill(mask == 0, 126), mask


def twin_hidden(model, ids, mask):
    """The twin on each row alone, unpadded: blocks and positions count from its first real token."""
    weights = dict(model.named_parameters())
    rows = []
    for n in range(ids.shape[0]):
        tokens = ids[n, int(mask[n].nonzero()[0]):]
        T = tokens.shape[0]
        rows.append(reference.forward(weights, model.config, tokens,
                                      reference.dense_block_causal_mask(T, model.block_length), torch.arange(T)))
    return rows


def test_forward_equals_the_fp64_twin_row_by_row_with_left_padding():
    model = tiny()
    ids, mask = left_padded()
    hidden = model(ids, attention_mask=mask)
    for n, expected in enumerate(twin_hidden(model, ids, mask)):
        torch.testing.assert_close(hidden[n, mask[n].bool()], expected, rtol=0, atol=1e-12)
    assert torch.isfinite(hidden).all()  # padding columns too (never used)


def test_the_twin_fails_a_model_with_another_attention():
    """The comparison has power: bidirectional attention (block_length >= the sequence) differs."""
    model = tiny()
    ids, mask = left_padded(B=1, pad=(0,))
    model.block_length = 64  # one block: bidirectional
    bidirectional = model(ids)[0]
    model.block_length = 4
    assert (bidirectional - twin_hidden(model, ids, mask)[0]).abs().max() > 1e-3


def test_block_mask_equals_a_dense_mask_built_pair_by_pair():
    for block in (1, 3, 4):
        ids, mask = left_padded(B=3, S=11, pad=(0, 1, 6))
        first = first_token(mask, 3, "cpu")
        allowed = block_causal(torch.arange(11), 11, first, block, mask)[:, 0]
        for n in range(3):
            f = int(first[n])
            dense = torch.zeros(11, 11, dtype=torch.bool)
            dense[f:, f:] = reference.dense_block_causal_mask(11 - f, block)
            dense[:f] = True  # a padding query, which no real key precedes, reads every key (never used)
            assert torch.equal(allowed[n], dense), (block, n)


def test_two_stream_mask_lets_noisy_blocks_read_clean_earlier_blocks_and_themselves():
    S, start, b = 9, 3, 4  # noisy copy of columns 3..8
    allowed, positions = two_stream(S, 2 * S - start, torch.tensor([0]), b, None)
    allowed = allowed[0, 0]
    column = list(range(S)) + list(range(start, S))
    for q in range(len(column)):
        for k in range(len(column)):
            qn, kn = q >= S, k >= S
            bq, bk = column[q] // b, column[k] // b
            expected = (bk <= bq) if not qn and not kn else (bk < bq) if qn and not kn else (bk == bq) if qn else False
            assert bool(allowed[q, k]) == expected, (q, k)
    assert positions[0].tolist() == column


def test_cached_forward_equals_the_plain_forward():
    """Rows whose blocks share boundaries (the rollout aligns them so): cached blocks are exact."""
    model = tiny().eval()
    ids, mask = left_padded(pad=(0, 4, 8))
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        cache = model.new_cache(3, ids.shape[1])
        model(ids[:, :8], attention_mask=mask[:, :8], cache=cache)
        rest = model(ids[:, 8:], attention_mask=mask, cache=cache, cache_start=8)
        window = model(ids[:, 8:12], attention_mask=mask, cache=cache, cache_start=torch.tensor(8), attend_length=13)
    real = mask.bool()
    torch.testing.assert_close(rest[real[:, 8:]], full[:, 8:][real[:, 8:]], rtol=0, atol=1e-12)
    torch.testing.assert_close(window[real[:, 8:12]], full[:, 8:12][real[:, 8:12]], rtol=0, atol=1e-12)


def test_forward_equals_transformers_qwen3_given_the_same_mask():
    """The architecture is Qwen3's: transformers' Qwen3ForCausalLM with these weights (same key names) and the
    block-causal mask gives the same hidden states (up to its rotary tables, built in fp32)."""
    transformers = pytest.importorskip("transformers")
    model = tiny()
    c = model.config
    qwen = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False, attn_implementation="sdpa")).double()
    qwen.load_state_dict(model.state_dict(), strict=True)
    ids, mask = left_padded()
    first = first_token(mask, 3, "cpu")
    allowed = block_causal(torch.arange(13), 13, first, model.block_length, mask)
    positions = (torch.arange(13)[None] - first[:, None]).clamp_min(0)
    captured = []
    qwen.get_output_embeddings().register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    qwen(input_ids=ids, attention_mask=allowed, position_ids=positions)
    torch.testing.assert_close(captured[0][mask.bool()], model(ids, attention_mask=mask)[mask.bool()],
                               rtol=0, atol=1e-5)


def test_presets_and_the_contract():
    assert {"sdar-tiny", "sdar-1.7b", "sdar-8b"} <= set(PRESETS)
    with torch.device("meta"):
        eight = SDARModel(SDARConfig.preset("sdar-8b"))
        small = SDARModel(SDARConfig.preset("sdar-1.7b"))
    assert sum(p.numel() for p in eight.parameters()) == 8_190_735_360  # SDAR-8B-Chat's index: 16.38 GB of bf16
    assert small.lm_head_weight is small.model["embed_tokens"].weight  # tied, as Qwen3-1.7B
    model = load_model("sdar-tiny", dtype=torch.float32, device="cpu")
    assert (block_length(model), model.logit_shift, model.mask_token_id) == (4, 0, 127)
    assert model.lm_head_weight.shape == (128, 64)
    assert block_length(tiny(block_size=2)) == 2
    pattern = SDARModel.lora_target_pattern(SDARModel.lora_target_modules)
    import re
    names = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names)


def official_config(**overrides):
    """A tiny config.json written as the official SDAR ones are (SDAR-8B-Chat's fields, tiny shapes)."""
    values = {"architectures": ["SDARForCausalLM"], "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
              "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}, "attention_bias": False,
              "attention_dropout": 0.0, "attn_implementation": "flex_attention", "bos_token_id": 100,
              "eos_token_id": 105, "block_size": 4, "mask_token_id": 109, "fuse_cross_entropy": True, "head_dim": 16,
              "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 256,
              "max_window_layers": 2, "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": False,
              "use_sliding_window": False, "vocab_size": 111}
    return {**values, **overrides}


def write_official_checkpoint(directory, config: dict, seed: int = 0, shards: int = 1):
    """Weights named and shaped by the official layout's rules, bf16, optionally sharded with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    d, ff, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    H, KV, V = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (H * hd, d), p + "self_attn.k_proj.weight": (KV * hd, d),
                       p + "self_attn.v_proj.weight": (KV * hd, d), p + "self_attn.o_proj.weight": (d, H * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff)})
    weights = {k: (torch.randn(s, generator=generator) * 0.1 + (1.0 if len(s) == 1 else 0.0)).bfloat16()
               for k, s in shapes.items()}
    names = sorted(weights)
    if shards == 1:
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in names[s::shards]}
            save_file(part, str(directory / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return weights


@pytest.mark.parametrize("shards", [1, 3])
def test_an_official_layout_checkpoint_loads_and_saves_back(tmp_path, shards):
    weights = write_official_checkpoint(tmp_path / "official", official_config(), shards=shards)
    assert model_class(tmp_path / "official") is SDARModel
    model = SDARModel.from_pretrained(tmp_path / "official")
    assert model.dtype == torch.bfloat16 and model.block_length == 4 and model.eos_token_id == 105
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    model.save_pretrained(tmp_path / "saved", max_shard_size=20_000)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "sdar" and saved["block_size"] == 4 and saved["auto_map"]["AutoConfig"]
    assert "eot_token_id" not in saved and "pad_token_id" not in saved  # not official fields
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)  # official keys, sharded
    again = SDARModel.from_pretrained(tmp_path / "saved", dtype=torch.float32, block_length=2)
    assert again.block_length == 2 and again.dtype == torch.float32
    ids = torch.randint(0, 100, (2, 9))
    again.block_length = 4
    torch.testing.assert_close(again(ids), model.float()(ids), rtol=0, atol=0)


def test_a_tied_checkpoint_has_no_lm_head_and_round_trips(tmp_path):
    write_official_checkpoint(tmp_path / "tied", official_config(tie_word_embeddings=True))
    model = SDARModel.from_pretrained(tmp_path / "tied", dtype=torch.float64)
    assert model.lm_head_weight is model.model["embed_tokens"].weight
    model.save_pretrained(tmp_path / "out")
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(SDARModel.from_pretrained(tmp_path / "out").lm_head_weight, model.lm_head_weight)


@pytest.mark.parametrize("change, message", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling=.* must be null"),
    (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(model_type="sdar_moe"), "the MoE variant is not implemented"),
    (dict(block_size=0), "block_size=0 must be an int >= 1"),
    (dict(num_key_value_heads=3), "must be a multiple of num_key_value_heads=3"),
    (dict(mask_token_id=105), "mask_token_id=105 is also eos_token_id"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, message):
    write_official_checkpoint(tmp_path, official_config())
    (tmp_path / "config.json").write_text(json.dumps(official_config(**change)))
    with pytest.raises(ValueError, match=message):
        SDARModel.from_pretrained(tmp_path)


def test_missing_block_size_and_wrong_shapes_are_refused(tmp_path):
    write_official_checkpoint(tmp_path, official_config())
    values = official_config()
    del values["block_size"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="has no block_size"):
        SDARModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(official_config(head_dim=8)))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_norm.weight in .* has shape \(16,\); the "
                                         r"config requires \(8,\)"):
        SDARModel.from_pretrained(tmp_path)
