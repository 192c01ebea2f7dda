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
from dllm_fast.files import atomic_directory
from dllm_fast.models import LLaDAConfig, LLaDAModel, checkpoint
from test_llada_model import OFFICIAL_CONFIG, P, official_weights, word_level_tokenizer, write_official_checkpoint


# -- interrupted saves ------------------------------------------------------------------------------------------

class SimulatedCrash(BaseException):
    """The process dies here: nothing after it runs, not even cleanup code."""


def crash_after(patch, steps, tokenizer=None):
    """Make the k-th file operation of a save its last: each file written, copied or linked, each rename or
    exchange and each directory removal counts as one. Returns the operation counter."""
    state = {"done": 0, "crashed": False}

    def counted(function, *, cleanup=False):
        def wrapped(*args, **kwargs):
            if state["crashed"]:
                if cleanup:  # a dead process removes nothing
                    return None
                raise SimulatedCrash
            result = function(*args, **kwargs)
            state["done"] += 1
            if state["done"] == steps:
                state["crashed"] = True
                raise SimulatedCrash
            return result
        return wrapped

    for module, name in [(checkpoint, "save_file"), (checkpoint, "_write_json"), (checkpoint, "_copy_file"),
                         (files, "_link_or_copy"), (files, "_rename"), (files, "_exchange")]:
        patch.setattr(module, name, counted(getattr(module, name)))
    patch.setattr(files, "_remove_tree", counted(files._remove_tree, cleanup=True))
    if tokenizer is not None:
        patch.setattr(tokenizer, "save_pretrained", counted(tokenizer.save_pretrained))
    return state


def official_directory(path):
    """An official single-file checkpoint with its tokenizer and remote code, plus a user's own files."""
    write_official_checkpoint(path, OFFICIAL_CONFIG, official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(1)))
    word_level_tokenizer(96).save_pretrained(path)
    (path / "configuration_llada.py").write_text("# the official remote-code config class\n")
    (path / "notes.txt").write_text("the user's notes")
    (path / "logs").mkdir()
    (path / "logs" / "run.txt").write_text("the user's log")
    return path


def checkpoint_state(path):
    model = LLaDAModel.from_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}, model.config.to_dict()


def same_state(a, b):
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


# Every pair of (swap, old layout, tokenizer) options, in four runs.
CRASH_CASES = [(True, "single", False), (True, "sharded", True), (False, "sharded", False), (False, "single", True)]


@pytest.mark.parametrize("exchange, old_layout, pass_tokenizer", CRASH_CASES,
                         ids=["exchange-single-carried", "exchange-sharded-given", "aside-sharded-carried",
                              "aside-single-given"])
def test_a_save_interrupted_after_any_file_leaves_the_old_or_the_new_checkpoint(
    tmp_path, monkeypatch, one_thread, exchange, old_layout, pass_tokenizer
):
    """Save a changed model (new weights and config, in 5 shards) over the checkpoint it was loaded from (one
    file, or the same 5 shard names), killed after each file operation in turn: the path loads exactly the old
    or exactly the new checkpoint, with its tokenizer, remote code and the user's files; the next save clears
    the leftovers. `exchange=False` takes the swap without RENAME_EXCHANGE."""
    template = official_directory(tmp_path / "template")
    if old_layout == "sharded":
        LLaDAModel.from_pretrained(template).save_pretrained(template, max_shard_size=20_000)
        assert (template / "model.safetensors.index.json").is_file()
    old = checkpoint_state(template)
    model = LLaDAModel.from_pretrained(template)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    model.config.rope_theta = 10000.0
    outcomes = []
    for steps in itertools.count(1):
        path = tmp_path / f"crash-{steps}" / "llada"
        shutil.copytree(template, path)
        model.name_or_path = str(path)  # saving into the directory it was loaded from
        tokenizer = word_level_tokenizer(96) if pass_tokenizer else None
        with monkeypatch.context() as patch:
            if not exchange:
                patch.setattr(files, "_exchange", lambda first, second: False)
            crash_after(patch, steps, tokenizer)
            try:
                model.save_pretrained(path, max_shard_size=20_000, tokenizer=tokenizer)
                finished = True
            except SimulatedCrash:
                finished = False
        missing = not path.exists()  # a crash between the rename-aside swap's two renames
        loaded = checkpoint_state(path)
        if finished:
            new = loaded
            assert len(list(path.glob("model-*-of-00005.safetensors"))) == 5
            break
        outcomes.append(("old" if same_state(loaded, old) else "unknown", missing, loaded))
        for name in ("tokenizer.json", "tokenizer_config.json", "configuration_llada.py"):
            assert (path / name).is_file(), (steps, name)
        assert (path / "notes.txt").read_text() == "the user's notes"
        assert (path / "logs" / "run.txt").read_text() == "the user's log"
        model.save_pretrained(path, max_shard_size=20_000)  # after the crash: succeeds, no leftovers remain
        assert os.listdir(path.parent) == ["llada"], steps
    outcomes = [("new" if kind == "unknown" and same_state(state, new) else kind, missing)
                for kind, missing, state in outcomes]
    assert all(kind in ("old", "new") for kind, _ in outcomes), outcomes
    assert {kind for kind, _ in outcomes} == {"old", "new"}, outcomes  # crashes before and after the swap
    assert any(missing for _, missing in outcomes) == (not exchange), outcomes
    assert len(outcomes) >= 10  # five shards, index, config, companions, user files, swap
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path)("w3 <|eot_id|>").input_ids == [3, 93]


def test_a_failed_save_leaves_the_old_checkpoint_and_no_staging_directory(tmp_path):
    path = official_directory(tmp_path / "llada")
    before = sorted(p.name for p in path.iterdir())
    old = checkpoint_state(path)

    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        LLaDAModel.from_pretrained(path).save_pretrained(path, tokenizer=BrokenTokenizer())
    assert os.listdir(tmp_path) == ["llada"]
    assert sorted(p.name for p in path.iterdir()) == before
    assert same_state(checkpoint_state(path), old)


def test_a_save_keeps_the_users_files_and_drops_stale_checkpoint_files(tmp_path):
    path = official_directory(tmp_path / "llada")
    save_file({"x": torch.zeros(1)}, path / "model-00002-of-00009.safetensors")  # a stale shard
    (path / "modeling_llada.py").write_text("# remote code\n")
    model = LLaDAModel(LLaDAConfig.preset("tiny"))  # loaded from nowhere: the directory's companions stay
    model.save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "configuration_llada.py", "logs", "model.safetensors", "modeling_llada.py", "notes.txt",
        "tokenizer.json", "tokenizer_config.json"]
    assert (path / "logs" / "run.txt").read_text() == "the user's log"
    ids = torch.randint(0, 120, (1, 5))
    assert torch.equal(LLaDAModel.from_pretrained(path).logits(ids), model.logits(ids))

    other = tmp_path / "other"  # a model loaded elsewhere brings that checkpoint's companions instead
    write_official_checkpoint(other, OFFICIAL_CONFIG, official_weights(OFFICIAL_CONFIG, torch.Generator().manual_seed(2)))
    (other / "configuration_llada.py").write_text("# the other checkpoint's remote code\n")
    LLaDAModel.from_pretrained(other).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "configuration_llada.py", "logs", "model.safetensors", "notes.txt"]
    assert (path / "configuration_llada.py").read_text() == "# the other checkpoint's remote code\n"


def test_atomic_directory_replaces_a_directory_whole(tmp_path):
    """The generic helper the trainer's checkpoints use: the old content is replaced, not merged."""
    path = tmp_path / "step"
    with atomic_directory(path) as staging:
        (staging / "optimizer.pt").write_text("one")
        (staging / "rng.pt").write_text("one")
    assert sorted(os.listdir(path)) == ["optimizer.pt", "rng.pt"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_directory(path) as staging:
            (staging / "optimizer.pt").write_text("two")
            raise RuntimeError("interrupted")
    assert (path / "optimizer.pt").read_text() == "one" and os.listdir(tmp_path) == ["step"]
    with atomic_directory(path, keep_old=lambda name: name == "rng.pt") as staging:
        (staging / "adapter.safetensors").write_text("two")
    assert sorted(os.listdir(path)) == ["adapter.safetensors", "rng.pt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="file exists and is not a directory"):
        with atomic_directory(tmp_path / "file"):
            pass


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_save_through_a_symlink_replaces_its_target(tmp_path):
    real = official_directory(tmp_path / "real")
    link = tmp_path / "latest"
    link.symlink_to(real)
    model = LLaDAModel.from_pretrained(link)
    model.config.rope_theta = 10000.0
    model.save_pretrained(link)
    assert link.is_symlink() and LLaDAModel.from_pretrained(real).config.rope_theta == 10000.0


def test_an_atomic_file_gets_the_permissions_of_a_plain_write(tmp_path):
    previous = os.umask(0o022)
    try:
        files.write_text_atomic(tmp_path / "new.json", "{}")
        (tmp_path / "plain.json").write_text("{}")
        assert (tmp_path / "new.json").stat().st_mode == (tmp_path / "plain.json").stat().st_mode  # 0644, not 0600
        os.chmod(tmp_path / "new.json", 0o640)
        files.write_text_atomic(tmp_path / "new.json", "[]")  # a replaced file keeps its mode
        assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o640
        assert (tmp_path / "new.json").read_text() == "[]" and sorted(os.listdir(tmp_path)) == ["new.json", "plain.json"]
    finally:
        os.umask(previous)


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


# -- issue 40: an index must be an object of file names inside the checkpoint; links out need consent -----------

def sharded_directory(path):
    """A sharded LLaDA checkpoint (model-0000i-of-0000n.safetensors + the index) of tiny weights."""
    LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny")).save_pretrained(path, max_shard_size=40_000)
    assert (path / checkpoint.INDEX_NAME).is_file()
    return path


def edit_index(path, change):
    index = json.loads((path / checkpoint.INDEX_NAME).read_text())
    change(index)
    (path / checkpoint.INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize("weight_map, kind", [([["model.transformer.ln_f.weight", "x.safetensors"]], "array"),
                                              ("model-00001-of-00002.safetensors", "string"), (None, "null"),
                                              (3, "number")])
def test_an_index_whose_weight_map_is_not_an_object_is_named(tmp_path, weight_map, kind):
    """Issue 40 item 7: a list raised "AttributeError: 'list' object has no attribute 'items'"."""
    path = sharded_directory(tmp_path / "ckpt")
    edit_index(path, lambda index: index.update(weight_map=weight_map))
    with pytest.raises(ValueError, match=rf"weight_map is a JSON {kind}; it must be an object mapping each "
                                         r"weight's name to its shard's file name"):
        LLaDAModel.from_pretrained(path)


def test_an_index_entry_that_is_no_file_name_is_named(tmp_path):
    path = sharded_directory(tmp_path / "ckpt")
    edit_index(path, lambda index: index["weight_map"].update({next(iter(index["weight_map"])): 7}))
    with pytest.raises(ValueError, match=r"weight_map\[.*\] = 7 must be a shard's file name"):
        LLaDAModel.from_pretrained(path)


def _first_shard_moved(path, outside):
    """Move the first shard to `outside` (a directory); returns (its name, its new path)."""
    name = sorted(p.name for p in path.glob("model-*.safetensors"))[0]
    outside.mkdir(exist_ok=True)
    moved = outside / name
    shutil.move(path / name, moved)
    return name, moved


@pytest.mark.parametrize("entry", ["absolute", "../outside/{name}", "sub/../../outside/{name}", "..\\\\outside\\\\{name}"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, entry):
    """Issue 40 item 8: absolute and ../ paths were loaded without a word."""
    path = sharded_directory(tmp_path / "ckpt")
    name, moved = _first_shard_moved(path, tmp_path / "outside")
    listed = str(moved) if entry == "absolute" else entry.format(name=name)
    edit_index(path, lambda index: index.update(
        weight_map={key: listed if file == name else file for key, file in index["weight_map"].items()}))
    for allow in (False, True):  # an index entry is a file name in the folder, whatever links are allowed
        with pytest.raises(ValueError, match=r"lists the shard .* which is not a file name inside the checkpoint"):
            LLaDAModel.from_pretrained(path, allow_external_links=allow)


@pytest.mark.parametrize("linked", ["shard", "single", "config.json", "index"])
def test_a_link_out_of_the_checkpoint_is_followed_only_when_allowed(tmp_path, linked):
    path = tmp_path / "ckpt"
    if linked == "single":
        LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny")).save_pretrained(path)
        name = checkpoint.SINGLE_NAME
    elif linked in ("config.json", "index"):
        sharded_directory(path)
        name = "config.json" if linked == "config.json" else checkpoint.INDEX_NAME
    else:
        sharded_directory(path)
        name = sorted(p.name for p in path.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(path / name, outside / name)
    (path / name).symlink_to(outside / name)
    expected = LLaDAModel.from_pretrained(path, allow_external_links=True).state_dict()
    with pytest.raises(ValueError, match=rf"{name} leads to .*elsewhere.*, outside the checkpoint directory .*; a "
                                         r"checkpoint reads only its own files.*allow_external_links=True"):
        LLaDAModel.from_pretrained(path)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        LLaDAModel.from_pretrained(path, device="meta")  # the skeleton (train's checks) too
    inside = tmp_path / "ckpt" / "kept"
    inside.mkdir()
    (path / name).unlink()
    shutil.move(outside / name, inside / name)
    (path / name).symlink_to(inside / name)  # a link within the folder is its own file
    loaded = LLaDAModel.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_hugging_face_cache_snapshot_loads_through_its_blob_links(tmp_path):
    """snapshots/<revision>/ holds links into the repository's blobs/: the cache's own layout, followed."""
    source = tmp_path / "source"
    sharded_directory(source)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{number}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    LLaDAModel.from_pretrained(snapshot)
    (snapshot / "config.json").unlink()
    (tmp_path / "other").mkdir()
    shutil.copy(source / "config.json", tmp_path / "other" / "config.json")
    (snapshot / "config.json").symlink_to(tmp_path / "other" / "config.json")  # not the cache's blobs
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        LLaDAModel.from_pretrained(snapshot)


def test_the_trainer_takes_the_consent_as_a_setting(tmp_path):
    from dllm_fast.assets import SUDOKU4_DIR
    from dllm_fast.train import TrainConfig
    from dllm_fast.train.run import model_and_tokenizer_plan

    path = tmp_path / "ckpt"
    shutil.copytree(SUDOKU4_DIR, path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(path / checkpoint.SINGLE_NAME, outside / checkpoint.SINGLE_NAME)
    (path / checkpoint.SINGLE_NAME).symlink_to(outside / checkpoint.SINGLE_NAME)
    with pytest.raises(ValueError, match=r"--allow-external-links true"):
        model_and_tokenizer_plan(TrainConfig(model=str(path)))
    model_and_tokenizer_plan(TrainConfig(model=str(path), allow_external_links=True))
    (path / "config.json").rename(outside / "config.json")
    (path / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(ValueError, match=r"config.json leads to .* outside the checkpoint directory"):
        TrainConfig(model=str(path))  # the family is found from config.json at once


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_integer_weights_are_refused_naming_the_model_family(tmp_path, family):
    """Issue 40 item 9: int8 SDAR weights got an error that spoke of "LLaDA weights"."""
    from dllm_fast.models import DreamConfig, DreamModel, SDARConfig, SDARModel

    cls, config, name = {"llada": (LLaDAModel, LLaDAConfig.preset("tiny"), "LLaDA"),
                         "sdar": (SDARModel, SDARConfig.preset("sdar-tiny"), "SDAR"),
                         "dream": (DreamModel, DreamConfig.preset("dream-tiny"), "Dream")}[family]
    cls.with_random_weights(config).save_pretrained(tmp_path)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / checkpoint.SINGLE_NAME)
    key = next(iter(weights))
    weights[key] = weights[key].to(torch.int8)
    save_file(weights, tmp_path / checkpoint.SINGLE_NAME)
    with pytest.raises(ValueError, match=rf"{re.escape(key)} in .* is stored as I8; {name} weights must be floating "
                                         r"point .* dllm_fast loads no quantized checkpoint") as error:
        cls.from_pretrained(tmp_path)
    assert family == "llada" or "LLaDA" not in str(error.value)


@pytest.mark.parametrize("family, preset, loaded", [  # each family, each way a loaded config names its dtype
    ("LLaDA2", "llada2-tiny", {"dtype": "bfloat16"}), ("SDAR", "sdar-tiny", {"torch_dtype": "bfloat16"}),
    ("Dream", "dream-tiny", {"torch_dtype": "bfloat16", "dtype": "bfloat16"}), ("LLaDA", "tiny", {})], ids=str)
def test_the_saved_config_says_the_dtype_the_weights_were_saved_in(tmp_path, family, preset, loaded):
    """Issue 45 item 7: an fp32 save of a bf16 checkpoint wrote the loaded config's "dtype": "bfloat16", so the
    official from_pretrained(dtype="auto") read the fp32 weights as bf16. Each dtype field the loaded config had
    (else torch_dtype) now says the dtype that holds most of the saved weights."""
    import dllm_fast.models as models

    cls, config_class = getattr(models, family + "Model"), getattr(models, family + "Config")
    config = dataclasses.replace(config_class.preset(preset), extra=dict(loaded))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        cls.with_random_weights(config, dtype=dtype, seed=0).save_pretrained(tmp_path / str(dtype))
        saved = json.loads((tmp_path / str(dtype) / "config.json").read_text())
        fields = {key: saved[key] for key in ("dtype", "torch_dtype") if key in saved}
        name = str(dtype).removeprefix("torch.")
        assert fields == ({key: name for key in loaded} or {"torch_dtype": name}), dtype
