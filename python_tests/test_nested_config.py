"""TrainConfig nested by role (issue 30 item 5): the sections are what the library reads, while every way users
gave settings before keeps working: the flags (train's and plan's), flat YAML/JSON files, flat keywords in Python,
and config.json files of earlier runs on resume. New runs write the nested form, which loads back equal."""

import dataclasses
import json

import pytest
import torch

from dllm_fast.train import TrainConfig, train
from dllm_fast.train import config as config_module
from dllm_fast.train.cli import add_config_arguments, config_from_arguments, main, new_parser, parse, parse_overrides
from dllm_fast.train.resume import saved_config
from dllm_fast.train.settings import (OPTIONS, SECTIONS, EvalSettings, LoraSettings, ObjectiveSettings, OptimSettings,
                                      RolloutSettings)

pytestmark = pytest.mark.usefixtures("one_thread")

# TrainConfig's fields before the nesting, as config.json files of earlier runs hold them (and the flags name them).
OLD_FIELDS = [
    "task", "task_options", "objective", "objective_options", "model", "tokenizer", "output_dir", "seed", "device",
    "threads", "steps", "prompts_per_step", "group_size", "inner_updates", "micro_batch", "score_micro_batch",
    "chunk_size", "gen_length", "block_length", "diffusion_steps", "temperature", "remasking", "cache", "threshold",
    "compile", "lr", "weight_decay", "betas", "grad_clip", "warmup_steps", "schedule", "lora", "lora_rank",
    "lora_alpha", "lora_dropout", "lora_targets", "gradient_checkpointing", "bf16", "parallel", "checkpoint_every",
    "resume", "overwrite", "eval_every", "eval_gen_lengths", "eval_examples", "eval_batch_size", "plot", "progress"]

# Settings added after the nesting (issue 40: a checkpoint's links out of its folder, SDAR's whole last block;
# issue 38: rollouts through merged LoRA adapters; issue 46: the rollout's weights, expert parallelism; issue 45:
# LLaDA2's EOS early stop, for block-diffusion models, so CHANGED, on a bidirectional model, leaves it at its default;
# issue 44: CJ-GRPO's decoders; issue 46: FSDP2's host offload).
NEW_FIELDS = ["allow_external_links", "expert_parallel", "full_last_block", "lora_merge_rollouts", "rollout_weights",
              "eos_early_stop", "unmask_schedule", "eos_schedule", "fsdp_offload", "reference_offload"]

# One non-default value of every setting, by flat key, and where the nested config holds it.
CHANGED = {"objective": "bgpo", "objective_options": {"n_t": 4}, "model": "tiny", "seed": 3, "steps": 7,
           "prompts_per_step": 4, "group_size": 2, "inner_updates": 2, "micro_batch": 16, "score_micro_batch": 32,
           "chunk_size": 1024, "gen_length": 32, "block_length": 16, "diffusion_steps": 8, "temperature": 0.5,
           "cache": "prefix", "compile": False, "lr": 2e-4, "weight_decay": 0.01, "betas": [0.8, 0.95],
           "grad_clip": 0.5, "warmup_steps": 5, "schedule": "cosine", "lora": True, "lora_rank": 8, "lora_alpha": 16,
           "lora_dropout": 0.1, "lora_targets": ["q_proj"], "lora_merge_rollouts": True,
           "gradient_checkpointing": True, "bf16": False,
           "checkpoint_every": 3, "eval_every": 4, "eval_gen_lengths": [32, 64], "eval_examples": 8,
           "eval_batch_size": 16, "plot": False, "progress": False, "threads": 1, "output_dir": "runs/nested",
           "allow_external_links": True, "full_last_block": True, "rollout_weights": "sharded",
           "expert_parallel": 2, "unmask_schedule": "ass", "eos_schedule": [0.01, 1.0], "parallel": "fsdp2",
           "fsdp_offload": True}  # reference_offload: refused with LoRA (test_offload.py)
WHERE = {"objective": ("objective", "name"), "objective_options": ("objective", "options"), "model": ("model", "name"),
         "steps": ("run", "steps"), "diffusion_steps": ("rollout", "steps"), "lr": ("optim", "lr"),
         "lora": ("lora", "enabled"), "lora_rank": ("lora", "rank"), "lora_targets": ("lora", "targets"),
         "eval_every": ("eval", "every"), "eval_gen_lengths": ("eval", "gen_lengths"), "seed": ("run", "seed"),
         "bf16": ("model", "bf16"), "compile": ("rollout", "compile"), "micro_batch": ("objective", "micro_batch")}


def cli_config(*arguments):
    parser = new_parser()
    add_config_arguments(parser)
    return config_from_arguments(parse(parser, list(arguments)))


def nested(values: dict) -> dict:
    """Flat settings as nested mappings, section by section."""
    out = {}
    for key, value in values.items():
        out.setdefault(OPTIONS[key].section, {})[OPTIONS[key].name] = value
    return out


# -- the sections are the source of truth ------------------------------------------------------------------------

def test_flat_keywords_land_in_their_sections_and_no_flat_attribute_is_left():
    config = TrainConfig(model="small", lr=1e-3, gen_length=32, block_length=32, diffusion_steps=16)
    assert (config.model.name, config.optim.lr, config.rollout.gen_length, config.rollout.steps) == (
        "small", 1e-3, 32, 16)
    assert isinstance(config.rollout, RolloutSettings) and isinstance(config.optim, OptimSettings)
    for key in set(OPTIONS) - set(SECTIONS):  # settings are read from their sections only
        assert not hasattr(config, key), key
    assert [f.name for f in dataclasses.fields(TrainConfig)] == list(SECTIONS)


def test_every_old_setting_keeps_its_flat_name_and_each_section_holds_it():
    # regrouped, none renamed (settings added since: NEW_FIELDS)
    assert list(OPTIONS) != OLD_FIELDS and sorted(OPTIONS) == sorted(OLD_FIELDS + NEW_FIELDS)
    config = TrainConfig(**CHANGED)
    for key, (section, name) in WHERE.items():
        assert getattr(getattr(config, section), name) == CHANGED[key], key
    assert config.flat() == {**TrainConfig().flat(), **CHANGED}


def test_flat_nested_and_section_objects_build_the_same_config():
    flat = TrainConfig(**CHANGED)
    assert TrainConfig(**nested(CHANGED)) == flat
    assert TrainConfig.from_dict(nested(CHANGED)) == flat == TrainConfig.from_dict(CHANGED)
    objects = {name: getattr(flat, name) for name in SECTIONS}
    assert TrainConfig(**objects) == flat
    assert TrainConfig(lora=LoraSettings(enabled=True, rank=8), eval={"every": 4}, lr=3e-4).lora.rank == 8
    # A section object is a base that flat keys override: dataclasses.replace and config.replace keep working.
    assert dataclasses.replace(flat, lr=1e-3).optim.lr == 1e-3 == flat.replace(optim={"lr": 1e-3}).optim.lr
    assert flat.replace(lr=1e-3).flat() == {**flat.flat(), "lr": 1e-3}


def test_to_dict_is_nested_and_round_trips_exactly():
    config = TrainConfig(**CHANGED)
    written = json.loads(json.dumps(config.to_dict()))
    assert list(written) == list(SECTIONS)
    assert written["optim"]["lr"] == 2e-4 and written["lora"] == {"enabled": True, "rank": 8, "alpha": 16,
                                                                   "dropout": 0.1, "targets": ["q_proj"],
                                                                   "merge_rollouts": True}
    assert TrainConfig.from_dict(written) == config and TrainConfig.from_dict(written).to_dict() == written


def test_rollout_settings_are_generate_configs_fields():
    from dllm_fast.rollout.config import SETTINGS

    assert {f.name for f in dataclasses.fields(RolloutSettings)} <= set(SETTINGS)
    rollout = TrainConfig(temperature=0.5, cache="dual").generate_config("cpu")
    assert (rollout.temperature, rollout.cache, rollout.steps, rollout.compile) == (0.5, "dual", 12, False)


@pytest.mark.parametrize("make, error, message", [
    (lambda: TrainConfig(lrr=1e-4), TypeError, r"unexpected keyword argument 'lrr' \(did you mean lr\?\)"),
    (lambda: TrainConfig(optim={"lrr": 1e-4}), TypeError, r"'optim.lrr' \(did you mean optim.lr\?\)"),
    (lambda: TrainConfig.from_dict({"stepz": 1}), ValueError, r"unknown training option\(s\) \['stepz'\] \(did you "
                                                              r"mean steps\?\)"),
    (lambda: TrainConfig.from_dict({"eval": {"evry": 1}}), ValueError, r"\['eval.evry'\] \(did you mean eval.every"),
    (lambda: TrainConfig(lr=1e-4, optim={"lr": 2e-4}), ValueError, r"optim.lr is given twice, as lr and as optim.lr"),
    (lambda: TrainConfig(run=3), TypeError, r"run = 3 must be a mapping of the run settings"),
    (lambda: TrainConfig(rollout={"gen_length": 30}), ValueError, r"--gen-length 30 is not a multiple of "
                                                                  r"--block-length 24"),
    (lambda: TrainConfig(gen_length=30), ValueError, r"--gen-length 30 is not a multiple of --block-length 24; "
                                                     r"pass --gen-length 24 or --gen-length 48"),
    (lambda: TrainConfig(optim=OptimSettings(lr=1e-4), lr="fast"), TypeError, r"--lr = 'fast' must be a number"),
    (lambda: EvalSettings(gen_lengths=[]), ValueError, r"--eval-gen-lengths must list at least one"),
    (lambda: ObjectiveSettings(name="nope"), ValueError, r"--objective 'nope' is not one of"),
])
def test_errors_name_the_key_or_the_flag_as_the_user_gave_it(make, error, message):
    with pytest.raises(error, match=message):
        make()


# -- config files: flat, nested, not both for one key -------------------------------------------------------------

def test_flat_and_nested_yaml_files_give_the_same_config(tmp_path):
    flat, deep = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("objective: bgpo\nobjective_options: {n_t: 4}\nlr: 1e-4\nlora: true\nlora_rank: 8\n"
                    "gen_length: 48\nblock_length: 48\n")
    deep.write_text("objective:\n  name: bgpo\n  options: {n_t: 4}\noptim:\n  lr: 1e-4\nlora:\n  enabled: true\n"
                    "  rank: 8\nrollout:\n  gen_length: 48\n  block_length: 48\n")
    config = TrainConfig.from_file(flat)
    assert TrainConfig.from_file(deep) == config
    assert (config.objective.name, config.optim.lr, config.lora.rank, config.rollout.gen_length) == (
        "bgpo", 1e-4, 8, 48)
    mixed = tmp_path / "mixed.yaml"  # flat and nested keys together, each setting once
    mixed.write_text("objective: bgpo\nobjective_options: {n_t: 4}\noptim: {lr: 1e-4}\nlora: true\nlora_rank: 8\n"
                     "rollout: {gen_length: 48, block_length: 48}\n")
    assert TrainConfig.from_file(mixed) == config
    json_file = tmp_path / "nested.json"
    json_file.write_text(json.dumps(config.to_dict()))
    assert TrainConfig.from_file(json_file) == config
    # On the command line: the nested file, then the flags over it.
    assert cli_config("--config", str(deep), "--lr", "3e-4", "--lora-rank", "4").flat() == {
        **config.flat(), "lr": 3e-4, "lora_rank": 4}


@pytest.mark.parametrize("text, message", [
    ("lr: 1e-4\noptim:\n  lr: 2e-4\n", r"run.yaml: optim.lr is given twice, as lr \(line 1\) and as optim.lr \(line "
                                     r"3\); keep one"),
    ("eval_every: 5\neval: {every: 6}\n", r"run.yaml: eval.every is given twice, as eval_every \(line 1\) and as "
                                         r"eval.every \(line 2\)"),
    ("optim:\n  lr: fast\n", r"run.yaml: optim.lr = 'fast' must be a number"),
    ("lora: {rnak: 4}\n", r"run.yaml: unknown option\(s\) \['lora.rnak'\] \(did you mean lora.rank\?\)"),
    ("lrr: 1e-4\n", r"run.yaml: unknown option\(s\) \['lrr'\] \(did you mean lr\?\)"),
    ("rollout: 3\n", r"run.yaml: rollout = 3 must be a mapping of the rollout settings"),
])
def test_a_config_file_names_the_key_that_is_wrong(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises((TypeError, ValueError), match=message):
        TrainConfig.from_file(path)
    with pytest.raises(SystemExit) as exit:  # the command line says the same in one line
        main(["--config", str(path), "--output-dir", str(tmp_path / "out")])
    assert exit.value.code == 2


# -- the command line: every flag, train's and plan's, and --help by section ------------------------------------------

def test_every_flag_keeps_its_name_and_meaning():
    arguments = []
    for key, value in CHANGED.items():
        words = value if isinstance(value, list) else [value]
        shown = [json.dumps(w) if isinstance(w, dict) else str(w).lower() if isinstance(w, bool) else str(w)
                 for w in words]
        arguments += ["--" + key.replace("_", "-"), *shown]
    assert parse_overrides(arguments) == CHANGED
    assert cli_config(*arguments) == TrainConfig(**CHANGED)


def test_help_groups_the_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    titles = [out.index(f"{name} settings (config.{name})") for name in SECTIONS]
    assert titles == sorted(titles)
    for setting in OPTIONS.values():  # each flag under its own section's title
        position = out.index(f"  {setting.flag} ")
        section = list(SECTIONS).index(setting.section)
        assert titles[section] < position < (titles + [len(out)])[section + 1], setting.flag


def test_plan_takes_trains_flags_in_the_same_groups(capsys):
    from dllm_fast.planning.cli import main as plan_main

    with pytest.raises(SystemExit):
        plan_main(["--help"])
    out = capsys.readouterr().out
    assert "planning options" in out and all(f"{name} settings (config.{name})" in out for name in SECTIONS)
    assert all(f"  {setting.flag} " in out for setting in OPTIONS.values())
    with pytest.raises(SystemExit) as exit:
        plan_main(["--gen-length", "30"])
    assert exit.value.code == 2
    assert "--gen-length 30 is not a multiple of --block-length 24" in capsys.readouterr().err


# -- resume: config.json of earlier (flat) runs -------------------------------------------------------------------

def test_a_flat_config_json_of_an_earlier_version_loads_with_its_settings(tmp_path):
    config = TrainConfig(**CHANGED)
    old = {key: config.flat()[key] for key in OLD_FIELDS}  # the flat object earlier versions wrote
    (tmp_path / "config.json").write_text(json.dumps(old, indent=2))
    assert saved_config(tmp_path) == config.replace(**{key: OPTIONS[key].field.default for key in NEW_FIELDS})


@pytest.mark.slow
def test_a_run_saved_with_a_flat_config_json_resumes_with_its_settings(tmp_path):
    run_dir = tmp_path / "run"
    quick = dict(steps=1, prompts_per_step=2, group_size=4, eval_every=10, checkpoint_every=1, eval_examples=4,
                 progress=False, plot=False, threads=1, objective="vrpo_ol", objective_options={"n_t": 2},
                 lr=3e-4, output_dir=str(run_dir))
    threads = torch.get_num_threads()
    train(TrainConfig(**quick))
    torch.set_num_threads(threads)
    for path in (run_dir / "config.json", run_dir / "checkpoint" / "config.json"):
        written = json.loads(path.read_text())
        assert list(written) == list(SECTIONS)  # new runs write the nested form
        path.write_text(json.dumps(TrainConfig.from_dict(written).flat()))  # as an earlier version wrote it
    resumed = cli_config("--output-dir", str(run_dir), "--resume", "true", "--steps", "2")
    assert (resumed.objective.name, resumed.objective.options, resumed.optim.lr, resumed.run.steps) == (
        "vrpo_ol", {"n_t": 2}, 3e-4, 2)
    with pytest.raises(ValueError, match=r"these options differ from it: --lr 0.001 \(saved: 0.0003\)"):
        cli_config("--output-dir", str(run_dir), "--resume", "true", "--lr", "1e-3")
    result = train(resumed)
    torch.set_num_threads(threads)
    assert result.resumed_at == 1 and result.steps == 2
    written = json.loads((run_dir / "config.json").read_text())
    assert written["run"]["steps"] == 2 and written["optim"]["lr"] == 3e-4  # what ran, nested again


# -- item 5's last sentence ----------------------------------------------------------------------------------------

def test_what_names_point_at_lives_in_sources_not_in_the_config_module():
    from dllm_fast.train import sources

    for name in ("model_source", "check_device", "lora_targets"):
        assert callable(getattr(sources, name)) and not hasattr(config_module, name)


def test_the_docs_nested_yaml_example_loads(tmp_path):
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "training-and-configuration.md").read_text()
    example = next(block for block in guide.split("```yaml\n")[1:] if "optim:" in block).split("```")[0]
    (tmp_path / "run.yaml").write_text(example)
    config = TrainConfig.from_file(tmp_path / "run.yaml", lr=2e-5)
    assert (config.objective.name, config.model.name, config.rollout.cache, config.optim.lr, config.lora.rank,
            config.run.steps, config.eval.gen_lengths) == ("spg", "small", "dual", 2e-5, 8, 200, [64, 128])


# -- issue 40: a repeated key is refused; one typed reading for flags, files and Python ----------------------------

@pytest.mark.parametrize("name, text, message", [
    ("run.yaml", "optim:\n  lr: 3.0e-4\n  warmup_steps: 10\nrun:\n  steps: 3\noptim:\n  lr: 1.0e-4\n",
     r"run.yaml: optim is given twice, on lines 1 and 6; keep one"),
    ("run.yaml", "lr: 1.0e-4\nsteps: 3\nlr: 2.0e-4\n", r"run.yaml: lr is given twice, on lines 1 and 3"),
    ("run.yaml", "optim: {lr: 1.0e-4, warmup_steps: 2, lr: 2.0e-4}\n", r"optim.lr is given twice, on lines 1 and 1"),
    ("run.yaml", "objective_options:\n  n_t: 2\n  n_t: 4\n", r"objective_options.n_t is given twice, on lines 2 and 3"),
    ("run.json", '{\n  "optim": {"lr": 0.0003, "warmup_steps": 10},\n  "optim": {"lr": 0.0001}\n}\n',
     r"run.json: optim is given twice, on lines 2 and 3"),
    ("run.json", '{"lr": 0.1,\n "steps": 2,\n\n "lr": 0.2}', r"run.json: lr is given twice, on lines 1 and 4"),
    ("run.json", '{"optim": {"lr": 0.1,\n "lr": 0.2}}', r"run.json: optim.lr is given twice, on lines 1 and 2"),
])
def test_a_key_or_section_given_twice_in_a_file_is_refused_naming_both_lines(tmp_path, name, text, message):
    """Issue 40 item 2: YAML and JSON keep the last of two equal keys; a second optim: block silently dropped the
    first one's lr and warm-up."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_file(path)
    with pytest.raises(SystemExit) as exit:
        main(["--config", str(path), "--output-dir", str(tmp_path / "out")])
    assert exit.value.code == 2 and not (tmp_path / "out").exists()


def test_equal_keys_in_different_places_are_not_repeats(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"task_options": {"rows": [{"a": 1}, {"a": 2}]}, "objective_options": {"n_t": 2}}')
    assert config_module.read_config_file(path)["objective_options"] == {"n_t": 2}
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("optim: {lr: 1.0e-4}\nlora: {rank: 4}\neval: {every: 3}\n")
    assert TrainConfig.from_file(yaml_file).lora.rank == 4


# Each setting as a flag's text, and what reads the same from a YAML file, a JSON file and Python: the one reading.
SAME = [
    ("compile", "1", True), ("compile", "true", True), ("compile", "no", False), ("compile", "Auto", "auto"),
    ("micro_batch", "Auto", "auto"), ("micro_batch", "16", 16), ("steps", "10", 10), ("steps", "1_000", 1000),
    ("lr", "1e-4", 1e-4), ("lr", "1", 1.0), ("lora", "On", True), ("lora", "0", False),
    ("threads", "none", None), ("threads", "null", None), ("eval_gen_lengths", "24", [24]),
    ("betas", ["0.9", "0.99"], [0.9, 0.99]), ("lora_targets", "q_proj", ["q_proj"]),
    ("lora_targets", "none", None), ("output_dir", "2024", "2024"), ("objective_options", '{"n_t": 2}', {"n_t": 2}),
]
REFUSED = [("compile", "2"), ("compile", "sometimes"), ("steps", "10.0"), ("steps", "1e3"), ("steps", "0x10"),
           ("steps", "ten"), ("lr", "fast"), ("lora", "maybe"), ("micro_batch", "2.5"), ("betas", ["0.9", "x"]),
           ("objective_options", "[1]"), ("eval_gen_lengths", "24 48")]


def _flag_value(key, text):
    return parse_overrides([f"--{key.replace('_', '-')}", *(text if isinstance(text, list) else [text])])[key]


def _file_values(tmp_path, key, text):
    """The setting as an unquoted YAML scalar, a quoted one, and a JSON string (lists item by item)."""
    def as_yaml(quote):
        return "[" + ", ".join(quote + t + quote for t in text) + "]" if isinstance(text, list) else quote + text + quote

    values = []
    for number, quote in enumerate(("", "'")):
        path = tmp_path / f"{key}{number}.yaml"
        path.write_text(f"{key}: {as_yaml(quote)}\n")
        values.append(lambda path=path: config_module.read_config_file(path)[key])
    path = tmp_path / f"{key}.json"
    path.write_text(json.dumps({key: text}))
    values.append(lambda: config_module.read_config_file(path)[key])
    values.append(lambda: getattr(getattr(TrainConfig(**_complete({key: text})), OPTIONS[key].section),
                                  OPTIONS[key].name))
    return values


def _complete(settings):
    """Settings that need a partner to be valid on their own (a threshold needs no steps...): none here."""
    return settings


@pytest.mark.parametrize("key, text, value", SAME)
def test_a_setting_reads_the_same_from_a_flag_a_file_and_python(tmp_path, key, text, value):
    """Issue 40 item 12: --compile 1 and --micro-batch Auto were taken while YAML compile: 1 and micro_batch: Auto
    were refused, and YAML betas: ['0.9', '0.99'] was taken while steps: '10' was refused."""
    assert _flag_value(key, text) == value
    if key == "objective_options" and text.startswith("{"):
        return  # a mapping's YAML notation is a mapping: tested below
    for read in _file_values(tmp_path, key, text):
        assert read() == value


@pytest.mark.parametrize("key, text", REFUSED)
def test_a_value_refused_as_a_flag_is_refused_in_a_file_and_in_python(tmp_path, key, text):
    with pytest.raises((TypeError, ValueError), match=f"--{key.replace('_', '-')}"):
        _flag_value(key, text)
    for read in _file_values(tmp_path, key, text):
        with pytest.raises((TypeError, ValueError), match=f"{key}|--{key.replace('_', '-')}"):
            read()


def test_json_and_python_numbers_and_booleans_read_as_their_text(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"compile": 1, "lora": 0, "steps": 10, "lr": 1e-4, "output_dir": 7}))
    read = config_module.read_config_file(path)
    assert (read["compile"], read["lora"], read["steps"], read["lr"], read["output_dir"]) == (True, False, 10, 1e-4, "7")
    path.write_text(json.dumps({"steps": 10.0}))
    with pytest.raises(TypeError, match=r"steps = 10.0 must be an integer"):
        config_module.read_config_file(path)
    path.write_text(json.dumps({"steps": True}))
    with pytest.raises(TypeError, match=r"steps = True must be an integer"):
        config_module.read_config_file(path)
    assert TrainConfig(compile=1, steps="10", lora="yes").flat()["compile"] is True
    with pytest.raises(TypeError, match=r"--lr = True must be a number"):
        TrainConfig(lr=True)


def test_a_mapping_setting_reads_its_notation_or_json_text(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("objective: espo\nobjective_options: {n_t: 2, beta: 1e-3}\n")
    assert TrainConfig.from_file(path).objective.options == {"n_t": 2, "beta": 1e-3}  # YAML 1.1's 1e-3 a number
    path.write_text("objective: espo\nobjective_options: '{\"n_t\": 2}'\n")
    assert TrainConfig.from_file(path).objective.options == {"n_t": 2}
