"""The objectives' registry: names listed without loading any objective, each built-in's class named as listed,
new objectives registered, and a wrong name or preset refused naming what is accepted (issue 32 items 11, 16)."""

import pytest

from dllm_fast import objectives

BUILT_IN = ("diffu_grpo", "wd1", "vrpo_ol", "bgpo", "spg", "espo", "rspo", "coupled_grpo", "gdpo", "tracerl")


def test_every_built_in_is_listed_under_its_class_name():
    assert objectives.available()[:len(BUILT_IN)] == BUILT_IN
    for name in BUILT_IN:
        objective = objectives.get(name)
        assert objective.name == name and type(objective) is getattr(objectives, type(objective).__name__)
        assert type(objective.config) is getattr(objectives, type(objective.config).__name__)


def test_a_new_objective_registers_and_a_clash_is_refused():
    class Mine(objectives.Objective):
        name = "mine_for_the_registry_test"
        Config = objectives.WD1Config

    try:
        assert objectives.register(Mine) is Mine and objectives.available()[-1] == Mine.name
        with pytest.raises(ValueError, match="an objective named 'wd1' is already registered \\(WD1\\)"):
            objectives.register(type("Other", (Mine,), {"name": "wd1"}))
    finally:
        objectives._REGISTRY.pop(Mine.name, None)


@pytest.mark.parametrize("call, error, message", [
    (lambda: objectives.get("spg", preset=["sudoku"]), TypeError,
     r"preset=\['sudoku'\] must be one preset's name \(a str\) or None; spg's presets: sudoku"),
    (lambda: objectives.get(["spg"]), TypeError, r"an objective is named by a str, got \['spg'\]; available: diffu_grpo"),
    (lambda: objectives.presets({"spg": 1}), TypeError, r"an objective is named by a str, got \{'spg': 1\}"),
    (lambda: objectives.get("sgp"), ValueError, r"unknown objective 'sgp'; available: diffu_grpo, wd1"),
])
def test_a_wrong_name_or_preset_is_named_with_what_is_accepted(call, error, message):
    with pytest.raises(error, match=message):
        call()
