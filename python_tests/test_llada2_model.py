"""The native LLaDA2 model: its forward against the plain fp64 twin written from the equations (reference/llada2.py),
whose experts are a dense sum over every expert weighted by the router; the router's choice and weights against the
definition (tie-free scores) and its properties under exact ties; the experts' providers (grouped GEMM, sorted
batched GEMM, the per-expert loop) against each other; the cached layout; the official checkpoint layout (per-expert
keys, LLaDA2.0-mini's config fields, shards, round trip, checks); presets and LoRA targets."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from dllm_fast.contracts import block_length
from dllm_fast.models import LLaDA2Config, LLaDA2Model
from dllm_fast.models.loading import PRESETS, load_model, model_class
from dllm_fast.models.moe import Experts, expected_active_experts, grouped_mm_available, route
from dllm_fast.reference import llada2 as reference
from dllm_fast.reference.sdar import dense_block_causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, EOS = 127, 126


def tiny(dtype=torch.float64, seed=1, **overrides):
    config = LLaDA2Config(**{**LLaDA2Config.preset("llada2-tiny").__dict__, "extra": {}, **overrides})
    return LLaDA2Model.with_random_weights(config, dtype=dtype, seed=seed)


def left_padded(B=3, S=13, seed=0, pad=(0, 2, 5)):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 120, (B, S), generator=generator)
    mask = torch.ones_like(ids)
    for n, count in enumerate(pad[:B]):
        mask[n, :count] = 0
    return ids.masked_fill(mask == 0, EOS), mask


def twin_hidden(model, ids, mask):
    """The twin on each row alone, unpadded: blocks and positions count from its first real token."""
    weights = reference.official_weights(model)
    rows = []
    for n in range(ids.shape[0]):
        tokens = ids[n, int(mask[n].nonzero()[0]):]
        T = tokens.shape[0]
        rows.append(reference.forward(weights, model.config, tokens, dense_block_causal_mask(T, model.block_length),
                                      torch.arange(T)))
    return rows


@pytest.mark.parametrize("provider", ["auto", "bmm", "loop"])
def test_forward_equals_the_fp64_twin_row_by_row_with_left_padding(provider):
    model = tiny()
    model.experts_provider = provider
    ids, mask = left_padded()
    hidden = model(ids, attention_mask=mask)
    for n, expected in enumerate(twin_hidden(model, ids, mask)):
        torch.testing.assert_close(hidden[n, mask[n].bool()], expected, rtol=0, atol=1e-12)
    assert torch.isfinite(hidden).all()


def test_the_twin_has_power_over_the_router_and_the_rotary_part():
    """A model whose expert bias is ignored, or that rotates every dimension, is told apart."""
    model = tiny()
    ids, mask = left_padded(B=1, pad=(0,))
    expected = twin_hidden(model, ids, mask)[0]
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.gate.expert_bias.mul_(20)  # the same scores, another choice
    assert (model(ids)[0] - expected).abs().max() > 1e-3
    full_rotary = tiny(partial_rotary_factor=1.0)
    assert (full_rotary(ids)[0] - expected).abs().max() > 1e-3


def test_routing_equals_the_definition_and_the_weights_are_normalised_then_scaled():
    config = LLaDA2Config.preset("llada2-tiny")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, dtype=torch.float64, generator=generator)
    weight = torch.randn(16, 64, dtype=torch.float64, generator=generator) / 8
    bias = torch.randn(16, dtype=torch.float64, generator=generator) / 10
    chosen, weights, scores = route(x, weight, bias, top_k=4, n_group=4, topk_group=2, scaling=2.5)
    expected, dense = reference.route(x, weight, bias, config)
    assert chosen.tolist() == expected  # the same experts, best first
    torch.testing.assert_close(weights, dense.gather(1, chosen), rtol=0, atol=1e-14)
    torch.testing.assert_close(weights.sum(-1), torch.full((40,), 2.5, dtype=torch.float64), rtol=0, atol=1e-12)
    groups = chosen // 4
    assert all(len(set(row)) <= 2 for row in groups.tolist())  # at most topk_group groups per token
    # the bias steers the choice, never the weights: the weights are the unbiased scores, normalised
    picked = torch.sigmoid(x @ weight.T).gather(1, chosen)
    torch.testing.assert_close(weights, 2.5 * picked / picked.sum(-1, keepdim=True), rtol=0, atol=1e-14)


def test_routing_under_exact_ties_keeps_a_valid_choice():
    """Duplicated router rows tie experts (and whole groups) exactly: the choice is still a top-k of the kept
    groups' biased scores, the kept groups are top groups, and the weights are the chosen scores normalised.
    (Which of tied experts is taken is torch.topk's rule, the official code's; the peer check against the
    official code on tied routers is in the report.)"""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(30, 64, generator=generator)
    weight = torch.randn(16, 64, generator=generator) / 8
    weight[1::2] = weight[0::2]
    weight[4:8] = weight[0:4]
    bias = torch.zeros(16)
    chosen, weights, scores = route(x, weight, bias, top_k=4, n_group=4, topk_group=2, scaling=2.5)
    biased = scores + bias
    group_scores = biased.view(30, 4, 4).topk(2, dim=-1).values.sum(-1)
    for t in range(30):
        kept = set((chosen[t] // 4).tolist())
        threshold = sorted(group_scores[t].tolist(), reverse=True)[1]
        assert all(group_scores[t, g] >= threshold for g in kept)
        pool = [e for e in range(16) if e // 4 in kept]
        worst = biased[t, chosen[t]].min()
        assert all(biased[t, e] <= worst for e in pool if e not in chosen[t].tolist())
        assert len(set(chosen[t].tolist())) == 4
    torch.testing.assert_close(weights.sum(-1), torch.full((30,), 2.5), rtol=1e-6, atol=1e-6)


def providers():
    return ["bmm", "loop"] + (["grouped_mm"] if grouped_mm_available() else [])


def test_the_experts_providers_agree_with_the_dense_sum_values_and_gradients():
    """Sorted dispatch (every provider) equals running every expert on every token weighted densely."""
    generator = torch.Generator().manual_seed(5)
    experts = Experts(8, 32, 16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(8, 32, 32, generator=generator) / 6)
        experts.down_proj.copy_(torch.randn(8, 32, 16, generator=generator) / 4)
    x = torch.randn(10, 32, generator=generator, requires_grad=True)
    others = torch.tensor([0, 1, 3, 4, 5, 6, 7])
    chosen = torch.stack([torch.cat([torch.tensor([2]), others[torch.randperm(7, generator=generator)[:2]]])
                          for _ in range(10)])  # expert 2 takes every token, others some or none
    weights = torch.rand(10, 3, generator=generator)
    dense = torch.zeros(10, 8).scatter_(1, chosen, weights)
    gate, up = experts.gate_up_proj.chunk(2, dim=1)
    expected = sum(dense[:, e:e + 1] * ((torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T))
                                        @ experts.down_proj[e].T) for e in range(8))
    grads = torch.autograd.grad(expected.square().sum(), (x, experts.gate_up_proj, experts.down_proj))
    for provider in providers():
        y, counts = experts(x, chosen, weights, provider)
        assert counts.tolist() == torch.bincount(chosen.flatten(), minlength=8).tolist()
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5, msg=provider)
        got = torch.autograd.grad(y.square().sum(), (x, experts.gate_up_proj, experts.down_proj))
        for g, e in zip(got, grads):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=provider)
    with pytest.raises(ValueError, match="experts provider 'fast' is not one of"):
        experts(x, chosen, weights, "fast")


def test_grouped_mm_is_refused_where_it_cannot_run():
    model = tiny()  # fp64: torch._grouped_mm takes bf16, fp16 and fp32
    model.experts_provider = "grouped_mm"
    with pytest.raises(ValueError, match="'grouped_mm' needs torch._grouped_mm .* use 'bmm'"):
        model(torch.randint(0, 120, (1, 5)))
    with pytest.raises(ValueError, match="experts_provider='x' is not one of"):
        model.experts_provider = "x"


def test_cached_forward_equals_the_plain_forward():
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


def test_the_padding_row_of_the_embedding_gets_no_gradient():
    """nn.Embedding(padding_idx=pad_token_id), as the official model: the pad (EOS) embedding does not train."""
    model = tiny()
    ids = torch.tensor([[5, EOS, 7, EOS, 9]])
    model(ids).sum().backward()
    grad = model.model["word_embeddings"].weight.grad
    assert grad[EOS].abs().max() == 0 and grad[5].abs().max() > 0


def test_presets_and_the_contract():
    assert {"llada2-tiny", "llada2-mini", "llada2-flash"} <= set(PRESETS)
    with torch.device("meta"):
        mini = LLaDA2Model(LLaDA2Config.preset("llada2-mini"))
        flash = LLaDA2Model(LLaDA2Config.preset("llada2-flash"))
    stored = sum(t.numel() for t in mini.state_dict().values())
    assert 2 * stored == 32_511_286_784  # LLaDA2.0-mini's index: total_size in bf16 (expert_bias included)
    assert sum(p.numel() for p in flash.parameters()) == 102_889_697_280
    model = load_model("llada2-tiny", dtype=torch.float32, device="cpu")
    assert (block_length(model), model.logit_shift, model.mask_token_id, model.eos_token_id) == (4, 0, MASK, EOS)
    assert model.lm_head_weight.shape == (128, 64) and model.config.rotary_dim == 8
    assert LLaDA2Model(LLaDA2Config.preset("llada2-tiny")).block_length == 4
    pattern = LLaDA2Model.lora_target_pattern(LLaDA2Model.lora_target_modules)
    names = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    # 3 layers x (query_key_value, dense) + the dense layer's 3 + 2 shared experts x 3
    assert len(names) == 3 * 2 + 3 + 2 * 3 and not any(".experts." in n or n.endswith("gate") for n in names)
    assert expected_active_experts(256, 8, 1) == 8 and 255 < expected_active_experts(256, 8, 2048) <= 256


OFFICIAL_FIELDS = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0, "dtype": "bfloat16",
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "llada2_moe", "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True, "n_group": 8,
    "norm_head": False, "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4, "num_shared_experts": 1,
    "output_dropout": 0.0, "output_router_logits": False, "pad_token_id": 156892, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000, "rotary_dim": 64,
    "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid", "sliding_window": 4096,
    "tie_word_embeddings": False, "topk_group": 4, "transformers_version": "4.57.1", "use_bias": False,
    "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True,
    "use_sliding_window": False, "using_split_qkv_in_self_attention": False, "vocab_size": 157184,
}  # LLaDA2.0-mini's config.json (LLaDA2.1-mini's is the same)
TINY_WIDTHS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, rotary_dim=4, num_experts=8, num_experts_per_tok=2, n_group=4,
                   topk_group=2, moe_intermediate_size=16, max_position_embeddings=256, vocab_size=111,
                   pad_token_id=105, mask_token_id=109)


def official_config(**overrides):
    """LLaDA2.0-mini's config.json with tiny widths (the embedded sudoku4 tokenizer's vocabulary and ids: a
    vocabulary of another size names its mask token)."""
    return {**OFFICIAL_FIELDS, **TINY_WIDTHS, **overrides}


def write_official_checkpoint(directory, config: dict, seed: int = 0, shards: int = 1):
    """Weights named and shaped by the official layout's rules (per-expert keys, expert_bias), bf16."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    d, ff, hd, V = config["hidden_size"], config["intermediate_size"], config["head_dim"], config["vocab_size"]
    H, KV, E, I = (config["num_attention_heads"], config["num_key_value_heads"], config["num_experts"],
                   config["moe_intermediate_size"])
    shapes = {"model.word_embeddings.weight": (V, d), "model.norm.weight": (d,), "lm_head.weight": (V, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "attention.query_key_value.weight": ((H + 2 * KV) * hd, d),
                       p + "attention.query_layernorm.weight": (hd,), p + "attention.key_layernorm.weight": (hd,),
                       p + "attention.dense.weight": (d, H * hd)})
        if i < config["first_k_dense_replace"]:
            shapes.update({p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                           p + "mlp.down_proj.weight": (d, ff)})
            continue
        shapes.update({p + "mlp.gate.weight": (E, d), p + "mlp.gate.expert_bias": (E,),
                       p + "mlp.shared_experts.gate_proj.weight": (I, d),
                       p + "mlp.shared_experts.up_proj.weight": (I, d), p + "mlp.shared_experts.down_proj.weight": (d, I)})
        for e in range(E):
            shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (I, d), p + f"mlp.experts.{e}.up_proj.weight": (I, d),
                           p + f"mlp.experts.{e}.down_proj.weight": (d, I)})
    weights = {k: (torch.randn(s, generator=generator) * (0.01 if k.endswith("expert_bias") else 0.1)
                   + (1.0 if len(s) == 1 and not k.endswith("expert_bias") else 0.0)).bfloat16()
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
    assert model_class(tmp_path / "official") is LLaDA2Model
    model = LLaDA2Model.from_pretrained(tmp_path / "official")
    assert model.dtype == torch.bfloat16 and model.block_length == 32 and model.mask_token_id == 109
    assert model.eos_token_id == 105 and model.config.rotary_dim == 4
    official = LLaDA2Model.official_state_dict(model.state_dict())
    assert set(official) == set(weights)
    for name, value in official.items():
        assert torch.equal(value, weights[name]), name
    model.save_pretrained(tmp_path / "saved", max_shard_size=20_000)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key, value in OFFICIAL_FIELDS.items():  # every official field is written back
        if key not in TINY_WIDTHS:
            assert saved[key] == value, key
    assert "block_size" not in saved and "eot_token_id" not in saved and saved["mask_token_id"] == 109
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)  # official per-expert keys, sharded
    again = LLaDA2Model.from_pretrained(tmp_path / "saved", dtype=torch.float32, block_length=4)
    assert again.block_length == 4 and again.dtype == torch.float32
    ids = torch.randint(0, 100, (2, 9))
    model.block_length = 4
    torch.testing.assert_close(again(ids), model.float()(ids), rtol=0, atol=0)


def test_the_mini_config_loads_as_the_mini_preset():
    config = LLaDA2Config.from_dict(OFFICIAL_FIELDS)
    preset = LLaDA2Config.preset("llada2-mini")
    assert {k: v for k, v in config.__dict__.items() if k != "extra"} == \
           {k: v for k, v in preset.__dict__.items() if k != "extra"}
    assert (config.mask_token_id, config.eos_token_id, config.rotary_dim) == (156895, 156892, 64)


@pytest.mark.parametrize("change, message", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling=.* must be null"),
    (dict(score_function="softmax"), "score_function='softmax' is not supported"),
    (dict(router_dtype="bf16"), "router_dtype='bf16' is not supported"),
    (dict(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias=False is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(use_qkv_bias=True), "use_qkv_bias=True is not supported"),
    (dict(use_qk_norm=False), "use_qk_norm=False is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(rotary_dim=8), "rotary_dim=8 disagrees with partial_rotary_factor=0.5 x head_dim=8 = 4"),
    (dict(n_group=3), "num_experts=8 must be a multiple of n_group=3"),
    (dict(topk_group=5), "topk_group=5 exceeds n_group=4"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the 4 experts"),
    (dict(model_type="llada2_moe_veomni"), "dFactory's training config"),
    (dict(mask_token_id=None), "add mask_token_id for a vocabulary of another size"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, message):
    write_official_checkpoint(tmp_path, official_config())
    values = {k: v for k, v in official_config(**change).items() if v is not None or k == "rope_scaling"}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=message):
        LLaDA2Model.from_pretrained(tmp_path)


def test_wrong_shapes_and_missing_experts_are_refused(tmp_path):
    write_official_checkpoint(tmp_path, official_config())
    (tmp_path / "config.json").write_text(json.dumps(official_config(moe_intermediate_size=8)))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.0.(gate|up|down)_proj.weight in .* has shape "
                                         r"\((16, 32|32, 16)\); the config requires \((8, 32|32, 8)\)"):
        LLaDA2Model.from_pretrained(tmp_path)
    weights = write_official_checkpoint(tmp_path, official_config())
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weights the config requires, e.g. "
                                         "model.layers.2.mlp.experts.5.up_proj.weight"):
        LLaDA2Model.from_pretrained(tmp_path)
