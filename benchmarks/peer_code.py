"""The peers' official code, found in their checkouts and loaded at run time: nothing of it is copied into dllm_fast.

A peers folder (`--peers DIR`, default `.gpu/peers/`) holds one checkout per repository, named `<owner>+<name>`,
plus any pure-Python wheels the peers import (einops for Fast-dLLM's model; Liger-Kernel and Cut Cross-Entropy for
the LM head), which are imported from the wheel files themselves (Python imports pure-Python code from a zip).

How each peer is loaded:

- samplers (LLaDA's generate.py, Fast-dLLM's llada/generate.py, SDAR's generate.py): imported as modules from
  their files (`load_module`); Fast-dLLM's imports its model package from llada/model/.
- RL losses (d1's DiffuGRPOTrainer, SPG's SPGTrainer, ESPO's ESPOTrainer): the trainer classes subclass TRL's
  GRPOTrainer of 2025 (TRL 0.16 / 0.18) and import wandb, deepspeed and TRL internals that neither this
  environment (TRL 1.x) nor the GPU machine has. Their loss code does not use any of it, so `official_functions`
  reads the named functions and methods from the checkout's file, drops their decorators (TRL's profiling) and
  compiles them against the few globals they use (torch, F, np, accelerate's set_seed, TRL's nanmin/nanmax);
  `TrainerStandIn` is an object with those methods and the attributes the loss reads (args, beta, _step, ...),
  set from the official recipes by the benchmark.

`FILES` lists the files each peer needs; benchmarks/pack_peers.sh copies only those (the GPU run carries at most
64 MiB).
"""

from __future__ import annotations

import ast
import importlib.util
import random
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Peer:
    repository: str  # owner/name on GitHub
    files: tuple[str, ...]  # what the benchmark reads, relative to the checkout

    @property
    def folder(self) -> str:
        return self.repository.replace("/", "+")


PEERS = {
    "llada": Peer("ML-GSAI/LLaDA", ("generate.py",)),
    "fast_dllm": Peer("NVlabs/Fast-dLLM", ("llada/generate.py", "llada/model/__init__.py",
                                           "llada/model/configuration_llada.py", "llada/model/modeling_llada.py")),
    "sdar": Peer("JetAstra/SDAR", ("generate.py",)),
    "d1": Peer("dllm-reasoning/d1", ("diffu-grpo/diffu_grpo_trainer.py",)),
    "spg": Peer("facebookresearch/SPG", ("spg/spg_trainer.py",)),
    "espo": Peer("ML-GSAI/ESPO", ("espo/espo_trainer.py",)),
}
# Pure-Python wheels a peer imports (distribution name as in the wheel's file name -> the module it provides).
WHEELS = {"einops": "einops", "liger_kernel": "liger_kernel", "cut_cross_entropy": "cut_cross_entropy"}


def default_peers_dir() -> Path:
    return Path(__file__).resolve().parents[1] / ".gpu" / "peers"


def missing(peers_dir: Path, name: str) -> str | None:
    """Why peer `name` cannot run from `peers_dir` (a checkout or one of its files is absent), or None."""
    peer = PEERS[name]
    root = Path(peers_dir) / peer.folder
    if not root.is_dir():
        return (f"no checkout {peer.folder} in {peers_dir} (fetch github.com/{peer.repository}; "
                f"benchmarks/pack_peers.sh copies the files it needs)")
    absent = [f for f in peer.files if not (root / f).is_file()]
    if absent:
        return f"{peer.folder} in {peers_dir} lacks {', '.join(absent)}"
    return None


def wheel_files(peers_dir: Path) -> dict[str, Path]:
    """module name -> the newest wheel in `peers_dir` that provides it."""
    found = {}
    for wheel in sorted(Path(peers_dir).glob("*.whl")):
        distribution = wheel.name.split("-", 1)[0]
        if distribution in WHEELS:
            found[WHEELS[distribution]] = wheel
    return found


def use_wheels(peers_dir: Path) -> list[str]:
    """Put the peers' wheels in `peers_dir` on sys.path, each only if its module does not import already (an
    installed copy wins); returns the modules taken from wheels."""
    taken = []
    for module, wheel in wheel_files(peers_dir).items():
        if importlib.util.find_spec(module) is None and str(wheel) not in sys.path:
            sys.path.append(str(wheel))
            taken.append(module)
    return taken


class PeerFileError(LookupError):
    """A peer's file that is there but does not load (a syntax error, a failing import, a missing definition):
    the peer's rows are errors naming the file; dllm_fast's own rows are not (bench_peers.guarded)."""


def load_module(peers_dir: Path, name: str, relative: str, module_name: str, search: tuple[str, ...] = ()):
    """The module in file `relative` of peer `name`'s checkout, imported as `module_name`; `search`: folders of the
    checkout put on sys.path first (for the file's own imports, e.g. Fast-dLLM's `from model.modeling_llada`)."""
    reason = missing(peers_dir, name)
    if reason:
        raise FileNotFoundError(reason)
    root = Path(peers_dir) / PEERS[name].folder
    if module_name in sys.modules:
        return sys.modules[module_name]
    for folder in search:
        path = str(root / folder)
        if path not in sys.path:
            sys.path.insert(0, path)
    spec = importlib.util.spec_from_file_location(module_name, root / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise PeerFileError(f"peer {name}'s file {root / relative} does not load: {type(error).__name__}: "
                            f"{error}") from error
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def set_seed(seed) -> None:
    """accelerate.utils.set_seed (what the official losses call) when accelerate is installed, else the same
    seeding: Python's, NumPy's and torch's global generators (CPU and every GPU)."""
    try:
        from accelerate.utils import set_seed as accelerate_set_seed
    except ImportError:
        seed = int(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
        return
    accelerate_set_seed(int(seed))


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """TRL's nanmin (the official losses log it): the minimum over the non-NaN values, NaN if there are none."""
    if torch.isnan(tensor).all():
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return torch.min(tensor[~torch.isnan(tensor)])


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """TRL's nanmax."""
    if torch.isnan(tensor).all():
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return torch.max(tensor[~torch.isnan(tensor)])


# The module-level names the official losses read (their files import them from torch, numpy, accelerate and TRL).
LOSS_GLOBALS = dict(torch=torch, F=F, nn=torch.nn, np=np, set_seed=set_seed, nanmin=nanmin, nanmax=nanmax,
                    random=random)


def official_functions(peers_dir: Path, name: str, relative: str, names: tuple[str, ...], *,
                       class_name: str | None = None, extra_globals: dict | None = None) -> dict[str, Callable]:
    """The functions `names` of file `relative` in peer `name`'s checkout: methods of `class_name`, or top-level
    functions when it is None; compiled without their decorators, against LOSS_GLOBALS (+ extra_globals), with the
    checkout's file name in their tracebacks. A name the file does not define is an error naming it."""
    reason = missing(peers_dir, name)
    if reason:
        raise FileNotFoundError(reason)
    path = Path(peers_dir) / PEERS[name].folder / relative
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as error:
        raise PeerFileError(f"peer {name}'s file {path} does not load: {type(error).__name__}: {error}") from error
    body = tree.body
    if class_name is not None:
        found = [node for node in body if isinstance(node, ast.ClassDef) and node.name == class_name]
        if not found:
            raise PeerFileError(f"peer {name}'s file {path} defines no class {class_name}")
        body = found[0].body
    functions = {node.name: node for node in body if isinstance(node, ast.FunctionDef)}
    absent = [n for n in names if n not in functions]
    if absent:
        raise PeerFileError(f"peer {name}'s file {path}{'::' + class_name if class_name else ''} defines no "
                            f"{', '.join(absent)}")
    nodes = []
    for n in names:
        node = functions[n]
        node.decorator_list = []  # TRL's profiling_decorator: timing logs only
        nodes.append(node)
    module = ast.Module(body=nodes, type_ignores=[])
    namespace = dict(LOSS_GLOBALS, **(extra_globals or {}))
    exec(compile(module, str(path), "exec"), namespace)
    return {n: namespace[n] for n in names}


class _Accelerator:
    """What the official losses ask of accelerate's Accelerator: gathering a metric (one process: the value)."""

    @staticmethod
    def gather_for_metrics(value):
        return value.detach().reshape(-1)


class TrainerStandIn:
    """An object with the official trainer's loss methods (bound as methods) and the attributes they read.

    methods: name -> function (from `official_functions`); attributes: set on the instance (args as a namespace).
    The logging the losses do (self._metrics, self.accelerator.gather_for_metrics, self.control) is given a
    place to go."""

    def __init__(self, methods: dict[str, Callable], **attributes: Any):
        for name, function in methods.items():
            setattr(self, name, types.MethodType(function, self))
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.accelerator = _Accelerator()
        self.control = types.SimpleNamespace(should_evaluate=False)
        for name, value in attributes.items():
            setattr(self, name, types.SimpleNamespace(**value) if name == "args" else value)


def main() -> None:
    """`python benchmarks/peer_code.py --files`: one line per file to carry, `<checkout folder>/<path>` (what
    pack_peers.sh copies)."""
    if sys.argv[1:] != ["--files"]:
        raise SystemExit("usage: python benchmarks/peer_code.py --files")
    for peer in PEERS.values():
        for relative in peer.files:
            print(f"{peer.folder}/{relative}")


if __name__ == "__main__":
    main()
