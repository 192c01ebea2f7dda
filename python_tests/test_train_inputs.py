"""What the trainer loads agrees, or it refuses before reading a weight (issue 17, items 6, 7 and 12): the model, its
config and its tokenizer share special ids and vocabulary; a reference policy shares the policy's vocabulary;
lengths fit the model's positions; absurd sizes and unusable devices, directories and files are one clear line."""

import json
import os
import re
import shutil

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.assets import SUDOKU4_DIR, SUDOKU4_TASK_OPTIONS
from dllm_fast.contracts import RolloutBatch
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.tasks import register_task
from dllm_fast.tasks.base import Example
from dllm_fast.tasks.sudoku4 import Sudoku4
from dllm_fast.train import TrainConfig, train
from dllm_fast.train import run as run_module
from dllm_fast.train.cli import main
from dllm_fast.train.run import load_model_and_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = dict(steps=1, prompts_per_step=2, group_size=2, eval_every=1, eval_examples=2, progress=False, plot=False,
             threads=1)


def config(tmp_path, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), **overrides})


def embedded_copy(tmp_path, **changes):
    """The embedded model's directory with config.json fields changed."""
    directory = tmp_path / "model"
    shutil.copytree(SUDOKU4_DIR, directory)
    values = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**values, **changes}))
    return directory


def nothing_written(tmp_path) -> bool:
    run_dir = tmp_path / "run"
    return not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".lock"}


# -- model, config and tokenizer agree --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_preset_takes_the_tokenizers_vocabulary_and_special_ids(tmp_path):
    """--model tiny used EOS 126 and mask 127 with a tokenizer of 111 tokens (EOS 105, mask 109): ids >= 111 reached
    the reward function as empty strings and completions never ended."""
    model, tokenizer = load_model_and_tokenizer(TrainConfig(model="tiny"), "cpu")
    assert model.lm_head_weight.shape[0] == len(tokenizer) == 111
    assert (model.eos_token_id, model.mask_token_id) == (tokenizer.eos_token_id, tokenizer.mask_token_id)
    result = train(config(tmp_path, model="tiny"))
    assert result.steps == 1


def test_a_checkpoint_whose_ids_differ_from_its_tokenizer_is_refused(tmp_path):
    directory = embedded_copy(tmp_path, mask_token_id=107)
    with pytest.raises(ValueError, match=r"the model '.*model' and the tokenizer .* disagree: mask_token_id is 109 in "
                                         r"the tokenizer but 107 in the model"):
        train(config(tmp_path, model=str(directory)))
    assert nothing_written(tmp_path)


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused(tmp_path):
    from dllm_fast.integrations.trl_example import build_tokenizer

    build_tokenizer().save_pretrained(str(tmp_path / "tokenizer"))  # 128 tokens, EOS 126, mask 127
    with pytest.raises(ValueError, match=r"the tokenizer has 128 tokens, the model's vocabulary 111 \(ids from 111 on "
                                         r"have no embedding\); eos_token_id is 126 in the tokenizer but 105"):
        train(config(tmp_path, tokenizer=str(tmp_path / "tokenizer")))
    assert nothing_written(tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"mask_token_id": 105}, r"mask_token_id=105 is also eos_token_id; the mask token must differ"),
    ({"model_type": "bert"}, r"model_type='bert' is not a LLaDA checkpoint"),
])
def test_a_config_that_is_not_llada_is_refused_at_load(tmp_path, changes, message):
    directory = embedded_copy(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        LLaDAModel.from_pretrained(directory)


def test_a_reference_model_with_another_vocabulary_is_refused():
    torch.manual_seed(0)
    policy = LLaDAModel(LLaDAConfig.preset("tiny"))
    other = LLaDAModel(LLaDAConfig(**{**vars(LLaDAConfig.preset("tiny")), "vocab_size": 130, "embedding_size": 130}))
    result = dllm_fast.generate(policy, torch.randint(0, 100, (4, 5)), gen_length=4, block_length=4, steps=4,
                                temperature=1.0, generator=torch.Generator().manual_seed(0))
    batch = RolloutBatch.from_generation(result, torch.tensor([0.0, 1.0, 1.0, 0.0]), group_size=4)
    objective = objectives.get("espo", n_t=2)
    assert objective.needs_reference
    with pytest.raises(ValueError, match=r"ref_model has a vocabulary of 130 tokens \(the policy's: 128\); a "
                                         r"reference policy must share the policy's tokenizer"):
        objective.backward(policy, batch, micro_batch=4, generator=torch.Generator().manual_seed(0), ref_model=other)
    objective.backward(policy, batch, micro_batch=4, generator=torch.Generator().manual_seed(0), ref_model=policy)


# -- lengths and sizes -------------------------------------------------------------------------------------------

class HugePrompt(Sudoku4):
    """sudoku4 with one training prompt of 10 MB."""

    name = "huge_prompt"

    def train_examples(self, seed=0):
        examples = super().train_examples(seed)
        return [Example(question="1" * 10_000_000, answer=examples[0].answer, data=examples[0].data)] + examples[1:]


def test_a_10_mb_prompt_is_refused_before_it_is_tokenised(tmp_path, monkeypatch):
    from dllm_fast.tasks import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # registered for this test only
    register_task("huge_prompt", lambda **options: HugePrompt(**options))
    with pytest.raises(ValueError, match=r"the training prompt '1111.*' has 10000\d\d\d characters, more than 488 "
                                         r"tokens can hold \(the model's 512 positions less --gen-length 24\)"):
        train(config(tmp_path, task="huge_prompt", task_options={**SUDOKU4_TASK_OPTIONS, "num_train": 10}))
    assert nothing_written(tmp_path)


@pytest.mark.slow
def test_sizes_that_cannot_work_are_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--lora-rank 1000000000 exceeds the model's width 64"):
        train(config(tmp_path, lora=True, lora_rank=10**9))
    with pytest.raises(ValueError, match=rf"--threads {os.cpu_count() + 1} is more than this machine's "
                                         rf"{os.cpu_count()} CPUs; use at most {os.cpu_count()}"):
        train(config(tmp_path, threads=os.cpu_count() + 1))
    monkeypatch.setattr(run_module, "free_memory", lambda device: 2**20)  # a device with 1 MiB free
    monkeypatch.setattr(run_module, "load_model", None)  # never reached
    with pytest.raises(ValueError, match=r"--model 'sudoku4' has [\d,]+ parameters: weights, gradients, AdamW's two "
                                         r"moments and the reference copy in fp32 take about 1.\d MiB, more than the "
                                         r"1.0 MiB free on cpu. Use a smaller model, --lora true or a larger device"):
        train(config(tmp_path))
    assert nothing_written(tmp_path)


# -- one line, before work --------------------------------------------------------------------------------------

def yaml_file(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("arguments, message", [
    (["--lr", "1e300"], r"--lr=1e\+300 must be in \(0.0, 1.0\]"),
    (["--weight-decay", "1e9"], r"--lr 0.0001 x --weight-decay 1000000000.0 = 100000: AdamW multiplies the weights "
                                r"by 1 - lr x weight_decay"),
    (["--device", "meta"], r"--device 'meta': the trainer runs on cpu or cuda"),
    (["--device", "bogus"], r"--device 'bogus' is not a torch device; use auto, cpu, cuda or cuda:N"),
    (["--device", "cpu:7"], r"--device 'cpu:7': the CPU has no index"),
    (["--tokenizer", os.path.dirname(__file__)], r"--tokenizer '.*python_tests' holds no tokenizer \(none of "
                                                 r"tokenizer.json"),
    (["--task-options", '{"bogus": 1}'], r"--task-options: task 'sudoku4' has no option 'bogus'; its options are"),
    (["--objective-options", '{"n_t": 1000000000}'], r"x espo's n_t 1000000000 = \d+ Monte Carlo samples per "
                                                     r"update, more than 1048576"),
    ("yaml:steps: [&a [1, 2], *a]\n", r"config file .*run.yaml is not valid YAML: aliases \(\*name\) are not "
                                      r"allowed"),
    ("yaml:steps: " + "[" * 50 + "1" + "]" * 50 + "\n", r"run.yaml: steps = \[+\.\.\.\]+ must be an integer"),
    ("yaml:# " + "x" * 2**20 + "\n", r"config file .*run.yaml has \d+ bytes; a training config is a few KB"),
])
def test_a_bad_value_is_one_line_naming_it_and_the_fix(arguments, message, capsys, tmp_path):
    if isinstance(arguments, str):
        arguments = ["--config", yaml_file(tmp_path, arguments.removeprefix("yaml:"))]
    with pytest.raises(SystemExit) as exit:
        main(["--output-dir", str(tmp_path / "run"), *arguments])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and len(error) < 600, error
    assert re.search(message, error), error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("output_dir, message", [
    ("file", r"--output-dir '.*file' is a file, not a directory"),
    pytest.param("file/run", r"cannot create the run directory .*file/run \(Not a directory\); pick an --output-dir",
                 marks=pytest.mark.slow),
])
def test_an_unusable_run_directory_is_named(output_dir, message, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit:
        main(["--output-dir", str(tmp_path / output_dir), *sum(([f"--{k.replace('_', '-')}", str(v).lower()]
                                                               for k, v in QUICK.items()), [])])
    assert exit.value.code == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and re.search(message, error), error


def test_running_out_of_memory_names_the_options_that_size_the_run(tmp_path, capsys, monkeypatch):
    from dllm_fast.train import loop

    def out_of_memory(run):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 124000000000 bytes.")

    monkeypatch.setattr(loop, "evaluate_lengths", out_of_memory)
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path / "run"), "--threads", "1", "--progress", "false"])
    error = capsys.readouterr().err
    assert "out of memory (" in error and "lower --micro-batch, --score-micro-batch, --eval-batch-size" in error


def test_paths_are_taken_as_text_from_python(tmp_path):
    config = TrainConfig(output_dir=tmp_path / "run", tokenizer=SUDOKU4_DIR)
    assert (config.run.output_dir, config.model.tokenizer) == (str(tmp_path / "run"), str(SUDOKU4_DIR))
    assert json.loads(json.dumps(config.to_dict()))["run"]["output_dir"] == str(tmp_path / "run")  # config.json
