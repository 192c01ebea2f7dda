"""Reading and writing LLaDA checkpoints in the official layout.

A checkpoint directory holds config.json (LLaDA's field names) and either model.safetensors or shards
model-0000i-of-0000n.safetensors listed in model.safetensors.index.json. Keys carry the official names,
"model.transformer.<...>.weight"; the native module's state_dict keys are the same without "model.". Other
families (SDAR, LLaDA2) reuse this with their config class (`cls.config_class`), key prefix (`key_prefix`) and, where
their modules hold some weights under other names, the mapping to and from the official names
(`official_state` / `native_state`).

A checkpoint reads nothing outside its own directory (`confined`): the index names files in it (no absolute
path, no `..`), and a symbolic link whose target lies elsewhere is followed only with
`allow_external_links=True`, except into the `blobs/` folder of the Hugging Face cache that holds a snapshot
(`snapshots/<revision>/` links there by design). A downloaded checkpoint cannot make the loader read other files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dllm_fast.files import atomic_directory, follow_umask, settled_directory
from dllm_fast.models.config import LLaDAConfig
from dllm_fast.validation import check_int

KEY_PREFIX = "model."
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files beside the weights that belong to the checkpoint: the tokenizer's and the generation defaults.
COMPANION_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json",
)


def read_config(path: Path, config_class=LLaDAConfig, *, allow_external_links: bool = False):
    """The checkpoint's config.json as `config_class` (the model family's; LLaDAConfig by default)."""
    config_file = path / "config.json"
    confined(config_file, path, allow_external_links)
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist; a checkpoint directory needs config.json.")
    try:
        values = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}); the checkpoint is corrupt.") from error
    try:
        return config_class.from_dict(values)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{config_file}: {error}") from error


def weight_files(path: Path, *, allow_external_links: bool = False) -> dict[str, list[str]]:
    """Map each safetensors file of the checkpoint to the keys the index says it holds (None: read its header).
    Every file lies in the checkpoint directory (`confined`)."""
    index_file = path / INDEX_NAME
    confined(index_file, path, allow_external_links)
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index_file} is corrupt: {error!r}; it needs a 'weight_map' object.") from error
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file}: weight_map is a JSON {_json_name(weight_map)}; it must be an object "
                             "mapping each weight's name to its shard's file name (re-download the checkpoint or "
                             "re-save it).")
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{index_file}: weight_map[{key!r}] = {name!r} must be a shard's file name.")
            files.setdefault(name, []).append(key)
        for name in files:
            confined(path / name, path, allow_external_links, listed=name)
        return files
    if (path / SINGLE_NAME).is_file():
        confined(path / SINGLE_NAME, path, allow_external_links)
        return {SINGLE_NAME: None}
    shards = sorted(p.name for p in path.glob("model*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} holds no model*.safetensors weights.")
    for name in shards:
        confined(path / name, path, allow_external_links)
    return {name: None for name in shards}


def confined(file: Path, directory: Path, allow_external_links: bool = False, *, listed: str | None = None) -> None:
    """Refuse a checkpoint file outside its directory: an index entry (`listed`) that is absolute or climbs out
    with `..`, or a symbolic link whose target lies outside `directory`, unless `allow_external_links` (links into
    the blobs/ folder of the Hugging Face cache holding a snapshot are the cache's own layout, and followed)."""
    if listed is not None and (Path(listed).is_absolute() or ".." in Path(listed).parts or "\\" in listed):
        raise ValueError(f"{directory / INDEX_NAME} lists the shard {listed!r}, which is not a file name inside the "
                         "checkpoint directory; a checkpoint reads only its own files (re-download it, or fix the "
                         "index's weight_map).")
    if allow_external_links or not os.path.lexists(file):
        return
    target, home = file.resolve(), directory.resolve()
    if home == target or home in target.parents:
        return
    cache = home.parent.parent / "blobs"  # <repo>/snapshots/<revision> links into <repo>/blobs
    if home.parent.name == "snapshots" and cache.resolve() in target.parents:
        return
    raise ValueError(f"{file} leads to {target}, outside the checkpoint directory {directory}; a checkpoint reads only "
                     "its own files. Copy the file in, or pass allow_external_links=True (train: "
                     "--allow-external-links true) if you trust where the link points.")


def _json_name(value) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def load_checkpoint(cls, path, *, dtype=None, device=None, allow_external_links: bool = False):
    """A model of class `cls` with the weights of the checkpoint directory `path` (see the module docstring;
    allow_external_links: follow symbolic links that lead out of the directory)."""
    dtype = _checked_dtype(dtype)
    device = _checked_device(device)
    if not isinstance(allow_external_links, bool):
        raise TypeError(f"allow_external_links={allow_external_links!r} must be True or False.")
    path = settled_directory(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; from_pretrained needs a checkpoint directory "
                                "(config.json and model*.safetensors).")
    config = read_config(path, getattr(cls, "config_class", LLaDAConfig), allow_external_links=allow_external_links)
    with torch.device("meta"):
        model = cls(config)
    expected = {name: tuple(p.shape) for name, p in official_state(cls, model.state_dict()).items()}
    prefix = key_prefix(cls)
    stored = _stored_weights(path, expected, prefix, family=_family_name(cls),
                             allow_external_links=allow_external_links)
    missing = sorted(set(expected) - set(stored))
    if missing:
        shown = ", ".join(prefix + k for k in missing[:5])
        raise ValueError(f"{path} lacks {len(missing)} weights the config requires, e.g. {shown}.")
    dtype = dtype or _majority_dtype(stored)
    model.load_state_dict(native_state(cls, _read_weights(stored, dtype, device)), strict=True, assign=True)
    model.name_or_path = str(path)
    return model


class _StoredWeight(NamedTuple):
    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def official_state(cls, state: dict) -> dict:
    """A state dict under the checkpoint's names: the family's `official_state_dict` where its modules store some
    weights otherwise (LLaDA2's stacked experts), else the state dict as it is."""
    convert = getattr(cls, "official_state_dict", None)
    return state if convert is None else convert(state)


def native_state(cls, state: dict) -> dict:
    """The inverse of official_state: the family's `native_state_dict`, else the state dict as it is."""
    convert = getattr(cls, "native_state_dict", None)
    return state if convert is None else convert(state)


def key_prefix(cls) -> str:
    """What the official key names add to the native module names: "model." for LLaDA (the default); a family
    whose modules are named as its checkpoint's keys (SDAR) sets `checkpoint_key_prefix = ""`."""
    return getattr(cls, "checkpoint_key_prefix", KEY_PREFIX)


def _stored_weights(path: Path, expected: dict[str, tuple[int, ...]], prefix: str = KEY_PREFIX, *,
                    family: str = "LLaDA", allow_external_links: bool = False) -> dict[str, _StoredWeight]:
    """Every weight of the checkpoint by native name, with its file, shape and dtype, from the safetensors
    headers alone (no tensor data is read); names, shapes and dtypes are checked against the architecture of the
    model `family` (named in messages)."""
    stored: dict[str, _StoredWeight] = {}
    for name, listed_keys in weight_files(path, allow_external_links=allow_external_links).items():
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {INDEX_NAME} but missing; the checkpoint is incomplete.")
        with _safetensors_reader(file, "cpu") as reader:
            keys = listed_keys if listed_keys is not None else list(reader.keys())
            absent = sorted(set(keys) - set(reader.keys()))
            if absent:
                raise ValueError(
                    f"{INDEX_NAME} lists {absent[0]!r} (and {len(absent) - 1} more) in {file}, which lacks it; "
                    "the index does not match its shards: re-download the checkpoint or re-save it."
                )
            for key in keys:
                native = _native_key(key, file, prefix)
                header = reader.get_slice(key)
                weight = _StoredWeight(file, key, tuple(header.get_shape()),
                                       _torch_dtype(header.get_dtype(), key, file, family))
                if native not in expected:
                    raise ValueError(f"{file} holds {key!r}, which the config's architecture does not have.")
                if weight.shape != expected[native]:
                    raise ValueError(f"{key} in {file} has shape {weight.shape}; the config requires {expected[native]}.")
                if native in stored:
                    raise ValueError(f"{key} is stored twice, in {stored[native].file} and {file}; remove one copy.")
                stored[native] = weight
    return stored


def _majority_dtype(stored: dict[str, _StoredWeight]) -> torch.dtype:
    """The dtype that holds the most weight elements (ties: the wider dtype): a checkpoint that mixes dtypes,
    e.g. bf16 matrices with fp32 norms, loads entirely in it, so the model runs in one dtype."""
    elements: dict[torch.dtype, int] = {}
    for weight in stored.values():
        elements[weight.dtype] = elements.get(weight.dtype, 0) + math.prod(weight.shape)
    return max(elements, key=lambda dtype: (elements[dtype], dtype.itemsize))


def _read_weights(stored: dict[str, _StoredWeight], dtype: torch.dtype, device: torch.device):
    if device.type == "meta":  # a skeleton: the shapes and dtypes were checked, no data is read
        return {name: torch.empty(w.shape, dtype=dtype, device=device) for name, w in stored.items()}
    by_file: dict[Path, dict[str, str]] = {}
    for name, weight in stored.items():
        by_file.setdefault(weight.file, {})[name] = weight.key
    state: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with _safetensors_reader(file, str(device)) as reader:
            for name, key in keys.items():
                state[name] = reader.get_tensor(key).to(dtype)
    return state


@contextlib.contextmanager
def _safetensors_reader(file: Path, device: str):
    try:
        with safe_open(str(file), framework="pt", device=device) as reader:
            yield reader
    except SafetensorError as error:
        raise ValueError(f"{file} is not a readable safetensors file ({error}); re-download or re-save it.") from error


# safetensors' dtype names of the floating-point dtypes a model can hold.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _torch_dtype(name: str, key: str, file: Path, family: str = "LLaDA") -> torch.dtype:
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{key} in {file} is stored as {name}; {family} weights must be floating point "
                         f"({', '.join(_SAFETENSORS_DTYPES)}): dllm_fast loads no quantized checkpoint, so "
                         "dequantize it (or load the unquantized release).")
    return _SAFETENSORS_DTYPES[name]


def _family_name(cls) -> str:
    """The model family as messages name it: its class's `family_name`, else the class name less "Model"."""
    return getattr(cls, "family_name", None) or cls.__name__.removesuffix("Model") or cls.__name__


def _checked_dtype(dtype):
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype={dtype!r} names no torch dtype; pass e.g. torch.bfloat16 or 'bfloat16'.")
        dtype = named
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype; pass torch.bfloat16, "
                         "torch.float16, torch.float32 or None (the checkpoint's own).")
    return dtype


def _checked_device(device):
    try:
        device = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a torch device ({error}); pass e.g. 'cpu' or 'cuda:0'.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but this torch has no usable CUDA device; pass device='cpu'.")
    return device


def _native_key(key: str, file: Path, prefix: str = KEY_PREFIX) -> str:
    if not key.startswith(prefix):
        raise ValueError(f"{file} holds {key!r}; this model family's weight names start with {prefix!r}.")
    return key[len(prefix):]


def save_checkpoint(model, path, *, max_shard_size: int, tokenizer=None) -> None:
    """Write the checkpoint into a staging directory beside `path` and swap it in whole (files.atomic_directory):
    an interrupted save leaves the old checkpoint loadable, never a mix. Files of the old directory that are
    not part of a checkpoint (see `_is_checkpoint_file`) are kept."""
    check_int("max_shard_size", max_shard_size, minimum=1, hint="bytes per safetensors file")
    # Companions come from the directory the model was loaded from (else `path`), read before the swap.
    source = Path(getattr(model, "name_or_path", None) or path)
    prefix = key_prefix(type(model))
    state = official_state(type(model), model.state_dict())
    tensors = {prefix + k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    names = (
        [SINGLE_NAME] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with atomic_directory(path, keep_old=lambda name: not _is_checkpoint_file(name)) as staging:
        for name, shard in zip(names, shards):
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            follow_umask(staging / name)  # save_file leaves 0600; the other files follow the umask
        if len(shards) > 1:
            _write_json(staging / INDEX_NAME, {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
            })
        config = model.config.to_dict()
        _write_json(staging / "config.json", {**config, **saved_dtype_fields(config, tensors.values())})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        _copy_companion_files(source, staging, tokenizer_files=tokenizer is None)


# config.json's names for the weights' dtype: transformers 5's, and the one before it (both read by from_pretrained).
DTYPE_FIELDS = ("dtype", "torch_dtype")


def saved_dtype_fields(config: dict, tensors) -> dict[str, str]:
    """The config.json fields that say the dtype the weights were saved in: the floating dtype that holds most
    of their elements (a bf16 model's fp32 router bias does not make it fp32), under each dtype field the loaded
    config had, else under torch_dtype. A loaded config's field is the dtype it was loaded from: an fp32 save of
    a bf16 checkpoint must not say bfloat16 (from_pretrained(dtype="auto") would read it as bf16)."""
    counts: dict[torch.dtype, int] = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    if not counts:
        return {}
    name = str(max(counts, key=counts.get)).removeprefix("torch.")
    return {field: name for field in ([f for f in DTYPE_FIELDS if f in config] or ["torch_dtype"])}


def _is_checkpoint_file(name: str) -> bool:
    """Files a save writes anew (weights, index, config, tokenizer, remote code); the old ones are dropped."""
    weights = name.startswith("model") and name.endswith(".safetensors")
    return weights or name in (INDEX_NAME, "config.json") or name in COMPANION_FILES or name.endswith(".py")


def _write_json(file: Path, values) -> None:
    file.write_text(json.dumps(values, indent=2))


def _copy_companion_files(source: Path, target: Path, *, tokenizer_files: bool) -> None:
    """Carry the remote-code files (config.json's auto_map names them) and, unless a tokenizer was saved, the
    tokenizer of the directory the model was loaded from, so that the saved checkpoint still loads with
    AutoTokenizer and trust_remote_code."""
    if not source.is_dir():
        return
    for file in source.iterdir():
        tokenizer_file = tokenizer_files and file.name in COMPANION_FILES
        if file.is_file() and (tokenizer_file or file.suffix == ".py") and not (target / file.name).exists():
            _copy_file(file, target / file.name)


def _copy_file(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
