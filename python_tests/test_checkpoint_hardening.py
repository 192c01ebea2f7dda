"""Checkpoints against careless or hostile use: interrupted saves, malformed config.json, mixed dtypes, meta
loads, empty batches (issue 10)."""

import dataclasses
import itertools
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from dllm_fast import files
from dllm_fast.models import LLaDAConfig, LLaDAModel, checkpoint
from test_llada_model import OFFICIAL_CONFIG, P, official_weights, word_level_tokenizer, write_official_checkpoint


# -- config.json ----------------------------------------------------------------------------------------------

# Wrong values of every LLaDAConfig field and of the fixed architecture values: (field, value, error, message).
BAD_FIELDS = [
    ("d_model", "64", TypeError, "d_model='64' must be an int >= 1"),
    ("d_model", None, TypeError, "d_model=None must be an int"),
    ("n_layers", 2.0, TypeError, "n_layers=2.0 must be an int"),
    ("n_layers", True, TypeError, "n_layers=True must be an int"),
    ("n_heads", 0, ValueError, "n_heads=0 must be an int >= 1"),
    ("n_kv_heads", 0, ValueError, "n_kv_heads=0 must be an int >= 1"),
    ("mlp_hidden_size", None, TypeError, "mlp_hidden_size=None must be an int"),
    ("vocab_size", -96, ValueError, "vocab_size=-96 must be an int >= 1"),
    ("embedding_size", 64, ValueError, "embedding_size=64 must be an int >= 96"),
    ("max_sequence_length", "4096", TypeError, "max_sequence_length='4096' must be an int"),
    ("rope_theta", None, ValueError, "rope_theta=None must be a finite number > 0"),
    ("rope_theta", "5e5", ValueError, "rope_theta='5e5' must be a finite number"),
    ("rms_norm_eps", -1e-5, ValueError, "rms_norm_eps=-1e-05 must be > 0"),
    ("weight_tying", "false", TypeError, "weight_tying='false' must be True or False"),
    ("mask_token_id", None, TypeError, "mask_token_id=None must be an int"),
    ("mask_token_id", 96, ValueError, r"mask_token_id=96 is outside the vocabulary \[0, 96\)"),
    ("eos_token_id", None, TypeError, "eos_token_id=None must be an int"),
    ("pad_token_id", 94.0, TypeError, "pad_token_id=94.0 must be an int"),
    ("eot_token_id", "93", TypeError, "eot_token_id='93' must be an int"),
    ("eot_token_id", -1, ValueError, "eot_token_id=-1 is outside the vocabulary"),
    ("block_group_size", 1.0, ValueError, "block_group_size=1.0 is not supported: dllm_fast's LLaDA implements only block_group_size=1"),
    ("rope", 1, ValueError, "rope=1 is not supported: dllm_fast's LLaDA implements only rope=True"),
]


def test_every_config_field_has_a_bad_value_case():
    fields = {f.name for f in dataclasses.fields(LLaDAConfig)} - {"extra"}
    assert fields <= {name for name, *_ in BAD_FIELDS}


@pytest.mark.parametrize("field, value, error, message", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, *_ in BAD_FIELDS])
def test_a_bad_config_field_is_rejected_at_load_by_name(tmp_path, field, value, error, message):
    """Rejected before any weight is read (the directory holds none), naming the file, the field and the type."""
    (tmp_path / "config.json").write_text(json.dumps({**OFFICIAL_CONFIG, field: value}))
    with pytest.raises(error, match=f"config.json: {message}"):
        LLaDAModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("content, kind", [([OFFICIAL_CONFIG], "array"), ("d_model", "string"), (None, "null")])
def test_config_json_must_be_an_object(tmp_path, content, kind):
    (tmp_path / "config.json").write_text(json.dumps(content))
    with pytest.raises(TypeError, match=f"config.json: the config must be a JSON object of fields, got a JSON {kind}"):
        LLaDAModel.from_pretrained(tmp_path)


def test_optional_config_fields_may_be_null_and_configs_round_trip():
    config = LLaDAConfig.from_dict({**OFFICIAL_CONFIG, "n_kv_heads": None, "embedding_size": None,
                                    "eot_token_id": None, "rope_theta": 10000})
    assert (config.n_kv_heads, config.embedding_size, config.eot_token_id) == (4, 96, None)
    assert config.rope_theta == 10000.0 and isinstance(config.rope_theta, float)
    for config in [LLaDAConfig.from_dict(OFFICIAL_CONFIG)] + [LLaDAConfig.preset(n) for n in ("tiny", "small", "llada-8b")]:
        written = json.loads(json.dumps(config.to_dict()))
        assert LLaDAConfig.from_dict(written).to_dict() == written


# -- dtypes and devices ---------------------------------------------------------------------------------------

def test_a_mixed_dtype_checkpoint_loads_in_its_majority_dtype(tmp_path):
    weights = official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(1))
    mixed = {k: v if k.endswith("norm.weight") or k.endswith("ln_f.weight") else v.bfloat16()
             for k, v in weights.items()}  # bf16 matrices, fp32 norms: LLaDA's own layout
    write_official_checkpoint(tmp_path, OFFICIAL_CONFIG, mixed)
    model = LLaDAModel.from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 90, (2, 7))
    assert torch.equal(model.logits(ids), LLaDAModel.from_pretrained(tmp_path, dtype=torch.bfloat16).logits(ids))
    fp32 = LLaDAModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(fp32.transformer["ln_f"].weight, weights[P + "ln_f.weight"])  # cast from the stored values

    mostly_fp32 = {k: v.bfloat16() if k.endswith("norm.weight") else v for k, v in weights.items()}
    write_official_checkpoint(tmp_path, OFFICIAL_CONFIG, mostly_fp32)
    assert {p.dtype for p in LLaDAModel.from_pretrained(tmp_path).parameters()} == {torch.float32}

    write_official_checkpoint(tmp_path, OFFICIAL_CONFIG, {**weights, P + "ln_f.weight": torch.ones(32, dtype=torch.int64)})
    with pytest.raises(ValueError, match="ln_f.weight in .*model.safetensors is stored as I64; LLaDA weights must be "
                                         "floating point"):
        LLaDAModel.from_pretrained(tmp_path)


def test_a_meta_load_gives_a_checked_skeleton(tmp_path):
    weights = official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(1))
    write_official_checkpoint(tmp_path, OFFICIAL_CONFIG, {k: v.bfloat16() for k, v in weights.items()}, shards=2)
    skeleton = LLaDAModel.from_pretrained(tmp_path, device="meta")
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in skeleton.parameters())
    assert skeleton.lm_head_weight.shape == (100, 32)
    assert LLaDAModel.from_pretrained(tmp_path, device="meta", dtype="float32").dtype == torch.float32
    assert skeleton(torch.zeros(1, 3, dtype=torch.long, device="meta")).shape == (1, 3, 32)
    with pytest.raises(ValueError, match="the model is on the meta device and holds no weights"):
        skeleton(torch.zeros(1, 3, dtype=torch.long))

    write_official_checkpoint(tmp_path, OFFICIAL_CONFIG, {**weights, P + "ln_f.weight": torch.ones(7)})
    (tmp_path / "model.safetensors.index.json").unlink()
    for shard in tmp_path.glob("model-*.safetensors"):
        shard.unlink()
    with pytest.raises(ValueError, match=r"ln_f.weight .* has shape \(7,\); the config requires \(32,\)"):
        LLaDAModel.from_pretrained(tmp_path, device="meta")


def test_weights_stored_twice_are_named(tmp_path):
    weights = official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(1))
    write_official_checkpoint(tmp_path, OFFICIAL_CONFIG, weights)
    save_file({P + "ln_f.weight": torch.ones(32)}, tmp_path / "model-extra.safetensors")
    (tmp_path / "model.safetensors").rename(tmp_path / "model-main.safetensors")
    with pytest.raises(ValueError, match="ln_f.weight is stored twice"):
        LLaDAModel.from_pretrained(tmp_path)


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent is not a directory; from_pretrained needs a checkpoint"):
        LLaDAModel.from_pretrained(tmp_path / "absent")


# -- empty batches --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 5), (2, 0), (5,)])
def test_a_forward_needs_a_nonempty_batch(shape):
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    with pytest.raises(ValueError, match=re.escape(f"input_ids must be [B, T] with B >= 1 sequences of T >= 1 "
                                                   f"tokens, got shape {shape}")):
        model(torch.zeros(shape, dtype=torch.long))


def test_a_kv_cache_needs_positive_sizes():
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    with pytest.raises(ValueError, match="batch=0 must be an int >= 1"):
        model.new_cache(0, 8)
    with pytest.raises(ValueError, match="capacity=0 must be an int >= 1"):
        model.new_cache(2, 0)
    with pytest.raises(TypeError, match="capacity=8.0 must be an int"):
        model.new_cache(2, 8.0)


def test_max_shard_size_is_checked(tmp_path):
    with pytest.raises(ValueError, match="max_shard_size=0 must be an int >= 1"):
        LLaDAModel(LLaDAConfig.preset("tiny")).save_pretrained(tmp_path, max_shard_size=0)
