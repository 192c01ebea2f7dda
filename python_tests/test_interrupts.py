"""Interrupts anywhere in `Objective.backward`, for every objective, one after another in one process: each leaves
every `.grad` bit-identical to what it was before the call, and none leaves state behind for the next call (a
guard that leaked would let the next interrupted call keep a partial gradient).

Where an interrupt can land: CPython raises a Ctrl-C's KeyboardInterrupt at the entry of a Python function and
after a C function returns (its effect done). A `sys.setprofile` hook sees exactly those points ('call' and
'c_return' events) and raises at the k-th; the hook removes itself when it raises, so each call gets one interrupt.
"""

import copy
import sys

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood.samplers import SAMPLERS
from dllm_fast.models import LLaDAConfig, LLaDAModel

pytestmark = pytest.mark.usefixtures("one_thread")

P, L, G = 4, 8, 2
SPREAD = 4  # interrupts spread evenly over each call, besides every point at the gradient guard's own code
GUARD = ("likelihood/gradients.py", "all_or_nothing")


class InterruptAt:
    """A profile hook that counts the points where a Ctrl-C can land and raises KeyboardInterrupt at the `at`-th
    (None: only counts, recording each point's file)."""

    def __init__(self, at=None):
        self.at, self.count, self.files = at, 0, []

    def __call__(self, frame, event, arg):
        if event not in ("call", "c_return"):
            return
        self.count += 1
        if self.at is None:
            self.files.append((frame.f_code.co_filename, frame.f_code.co_name))
        elif self.count == self.at:
            raise KeyboardInterrupt(f"interrupt at point {self.at}")

    def run(self, call):
        sys.setprofile(self)
        try:
            return call()
        finally:
            sys.setprofile(None)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny"))


def rollout_batch(model):
    """N = 4 rollouts in groups of 2, one ending early with EOS, one with a left-padded prompt, each decoded two
    positions per step in a random order (the unmask_step TraceRL replays)."""
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 120, (4, P + L), generator=gen)
    sequences[0, P + 5:] = model.eos_token_id
    attention_mask = torch.ones_like(sequences)
    attention_mask[-1, :2] = 0
    unmask_step = torch.rand(4, L, generator=gen).argsort(-1).argsort(-1) // 2
    return RolloutBatch(sequences, attention_mask, P, completion_mask(sequences[:, P:], model.eos_token_id),
                        torch.tensor([1.0, 0.0, 0.25, 0.75]), G, unmask_step)


def objective(name):
    sampler = objectives.get(name).config.sampler
    options = {"n_t": {"coupled": 3, "trajectory": 1}.get(sampler, 2)}
    if sampler == "block":
        options["block_length"] = 4
    if SAMPLERS[sampler].data_n_t:  # trajectory states, autoregressive positions: from the rollouts
        options["n_t"] = None
    if SAMPLERS[sampler].model_blocks:  # the tiny model is bidirectional: one block, the whole completion
        options["sampler"] = "stratified_l"
    return objectives.get(name, **{k: v for k, v in options.items() if v is not None})


def grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def points_to_interrupt(files):
    """Every point in the gradient guard's own code and the one just after each (where a Ctrl-C lands once the
    guard is set, or once it is done), then SPREAD points evenly over the whole call."""
    guard = [k + 1 for k, (file, function) in enumerate(files) if file.endswith(GUARD[0]) and function == GUARD[1]]
    spread = [round(len(files) * (i + 0.5) / SPREAD) for i in range(SPREAD)]
    return sorted({k for point in guard for k in (point, point + 1)}) + spread


def test_an_interrupt_at_any_point_of_any_objective_leaves_gradients_bit_identical():
    """Issue 32 item 1: an interrupt between the guard's state change and its `try` used to leave the guard set
    for the rest of the process, after which every interrupted call kept a partial gradient."""
    model = tiny_model()
    reference_model = copy.deepcopy(model)
    batch = rollout_batch(model)
    gen = torch.Generator().manual_seed(5)
    failures = []
    for name in objectives.available():
        if name == "mdpo":  # trains on its StepBatch (test_mdpo.py): the same all-or-nothing backward
            continue
        if name == "d_treerpo":  # trains on a TreeBatch of tree edges (python_tests/test_d_treerpo.py)
            continue
        chosen = objective(name)
        masks = chosen.draw_masks(batch, generator=torch.Generator().manual_seed(1), eos_token_id=model.eos_token_id)
        update = objectives.InnerUpdate(masks)

        def call():
            return chosen.backward(model, batch, update, micro_batch=3, ref_model=reference_model)

        call()  # warm: first calls take other paths (lazy imports, caches)
        counter = InterruptAt()
        counter.run(call)
        for at in points_to_interrupt(counter.files):
            for p in model.parameters():  # gradients an earlier call left (the guard must copy them)
                p.grad = torch.randn(p.shape, generator=gen)
            before = grads(model)
            grad_mode = torch.is_grad_enabled()
            try:
                InterruptAt(at).run(call)
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            finally:
                torch.set_grad_enabled(grad_mode)  # torch.no_grad's own exit is Python: an interrupt there leaks
            if interrupted and not same(grads(model), before):
                failures.append(f"{name}: interrupt at point {at} of {counter.count} ({counter.files[at - 1]})")
    assert not failures, "\n".join(failures)


def guards(tmp_path):
    """(name, a block that enters the guard and leaves it, whether the state it changes is back to normal)."""
    from dllm_fast.likelihood import gradients
    from dllm_fast.models import llada
    from dllm_fast.ops import backend
    from dllm_fast.train.run_dir import RunDirectory
    from dllm_fast.validation import data_checks_enabled, values_checked

    model, run_dir = tiny_model(), RunDirectory(tmp_path / "run")

    def enter(context):
        def block():
            with context:
                pass
        return block

    def lock_is_free():
        other = RunDirectory(tmp_path / "run")
        with other.locked():
            return run_dir._lock_fd is None

    return [
        ("values_checked", lambda: enter(values_checked()), lambda: data_checks_enabled(torch.zeros(1))),
        ("chunks_sized_for", lambda: enter(backend.chunks_sized_for("cuda")),
         lambda: backend._CHUNK_DEVICE.get() is None),
        ("default_dtype", lambda: enter(llada._default_dtype(torch.float64)),
         lambda: torch.get_default_dtype() == torch.float32),
        ("embedding_grads_in_place", lambda: enter(gradients.embedding_grads_in_place(model)),
         lambda: not any(m._forward_hooks for m in model.modules())),
        ("run_directory_lock", lambda: enter(run_dir.locked()), lock_is_free),
    ]


@pytest.mark.parametrize("index", range(5))
def test_an_interrupt_at_any_point_of_a_guard_leaves_no_state_behind(tmp_path, index):
    """Issue 32 item 1, the neighbours: every guard of the library that changes state for a block (a context
    variable, the default dtype, hooks, gradient sync, a lock) put it back after an interrupt at any point of
    its entry and exit. Each used to change it before its `try`."""
    name, make_block, restored = guards(tmp_path)[index]
    counter = InterruptAt()
    counter.run(make_block())
    assert restored(), name
    for at in range(1, counter.count + 1):
        try:
            InterruptAt(at).run(make_block())
        except KeyboardInterrupt:
            pass
        assert restored(), f"{name}: interrupt at point {at} of {counter.count} ({counter.files[at - 1]})"
