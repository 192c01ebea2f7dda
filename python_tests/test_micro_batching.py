"""MicroBatching everywhere (issue 30 item 4): the trainer's micro-batch flags are packed into one `MicroBatching`
once (train/config.py's `micro_batching`), and that very object reaches every scoring call and the engine; the
engine's entry points take it whole."""

import inspect

import pytest

from dllm_fast.likelihood import MicroBatching, engine, scoring
from dllm_fast.train import train
from test_trainer import quick_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["espo", pytest.param("diffu_grpo", marks=pytest.mark.slow)])  # one-pass and separable; both score old and reference
def test_a_training_step_packs_the_micro_batch_once_and_the_engine_gets_that_object(tmp_path, monkeypatch, name):
    created, seen = [], []
    post_init = MicroBatching.__post_init__
    monkeypatch.setattr(MicroBatching, "__post_init__", lambda self: created.append(self) or post_init(self))

    def recording(function, position):
        def record(*args, **kwargs):
            seen.append((function.__name__, args[position] if len(args) > position else kwargs["micro_batch"]))
            return function(*args, **kwargs)
        return record

    monkeypatch.setattr(engine, "_two_pass", recording(engine._two_pass, 4))
    monkeypatch.setattr(engine, "_separable", recording(engine._separable, 4))
    monkeypatch.setattr(engine, "_one_pass", recording(engine._one_pass, 5))
    import dllm_fast.objectives.base as objective_base  # the objectives' old and reference scoring

    monkeypatch.setattr(objective_base, "score", recording(objective_base.score, 3))
    train(quick_config(tmp_path, objective=name, objective_options={"n_t": 2} if name == "espo" else {}, steps=1,
                       inner_updates=2, micro_batch=3, score_micro_batch=5, eval_every=10, checkpoint_every=10,
                       eval_examples=4))
    assert len(created) == 1 and (created[0].micro_batch, created[0].scoring) == (3, 5)
    calls = {function for function, _ in seen}
    assert calls == {"score", "_one_pass" if name == "espo" else "_separable"}, calls
    assert all(batching is created[0] for _, batching in seen)


@pytest.mark.parametrize("function", [engine.streaming_backward, engine._two_pass, engine._separable,
                                      engine._one_pass])
def test_the_engines_functions_take_at_most_8_parameters(function):
    assert len(inspect.signature(function).parameters) <= 8


@pytest.mark.parametrize("function, parameter", [(scoring.score, "micro_batch"), (engine._two_pass, "batching"),
                                                 (engine._separable, "batching"), (engine._one_pass, "batching")])
def test_score_and_the_engines_paths_take_the_micro_batching_object(function, parameter):
    assert "MicroBatching" in str(inspect.signature(function).parameters[parameter].annotation)
    assert not {"chunk_size", "compile", "score_micro_batch"} & set(inspect.signature(function).parameters)
