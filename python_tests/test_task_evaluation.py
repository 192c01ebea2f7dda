"""Prompt encoding, completion decoding and greedy task evaluation through `generate`, on a tiny model."""

import pytest
import torch

from dllm_fast import generate
from dllm_fast.assets.char_tokenizer import build_char_tokenizer, special_token_ids
from dllm_fast.contracts import GenerationResult, completion_mask
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.tasks import Example, Task
from dllm_fast.tasks.encoding import decode_completions, encode_prompts
from dllm_fast.train.evaluation import evaluate


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    config = LLaDAConfig(d_model=32, n_layers=2, n_heads=2, mlp_hidden_size=64, vocab_size=len(tokenizer),
                         max_sequence_length=128, rope_theta=10000.0, **special_token_ids(tokenizer))
    return LLaDAModel.with_random_weights(config, seed=0)


class EchoTask(Task):
    """Prompts of different lengths; a completion is correct when it starts with the example's answer."""

    name = "echo"

    def __init__(self, examples):
        self.examples = examples

    def train_examples(self, seed=0):
        return list(self.examples)

    def test_examples(self):
        return list(self.examples)

    def reward_components(self, example, completion):
        return {"match": 1.0 if completion.startswith(example.answer) else 0.0, "length": len(completion) / 100}

    def correct(self, example, completion):
        return completion.startswith(example.answer)


def test_encode_prompts_left_pads_with_the_pad_token(tokenizer):
    ids, mask = encode_prompts(tokenizer, ["ab", "abcd"])
    pad = tokenizer.pad_token_id
    assert ids.tolist() == [[pad, pad] + tokenizer("ab")["input_ids"], tokenizer("abcd")["input_ids"]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    ids, mask = encode_prompts(tokenizer, ["ab", "cd"])
    assert mask is None and ids.shape == (2, 2)
    with_bos = encode_prompts(tokenizer, [tokenizer.bos_token + "a"])[0]
    assert with_bos.tolist() == [[tokenizer.bos_token_id, tokenizer("a")["input_ids"][0]]]  # no second BOS
    with pytest.raises(ValueError, match="prompt 1 encodes to no tokens"):
        encode_prompts(tokenizer, ["a", ""])
    with pytest.raises(ValueError, match="non-empty sequence of prompt strings"):
        encode_prompts(tokenizer, "a single string")


def test_decode_completions_stops_at_the_first_eos_and_skips_special_tokens(tokenizer):
    eos, eot = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>")
    a, b = tokenizer("ab")["input_ids"]
    answer = tokenizer("<answer>")["input_ids"][0]
    completion = torch.tensor([[answer, a, eot, eos, b, b], [a, a, a, a, a, a]])
    result = GenerationResult(torch.cat([torch.zeros(2, 1, dtype=torch.long), completion], 1), completion,
                              completion_mask(completion, eos), nfe=1)
    assert decode_completions(tokenizer, result) == ["<answer>a", "aaaaaa"]


def test_evaluate_scores_every_example_and_is_independent_of_the_batch_size(one_thread, tokenizer, model):
    examples = [Example(question=q, answer=a) for q, a in [("1", "x"), ("22", "y"), ("333", "z"), ("4", "w"),
                                                            ("5555", "v")]]
    task = EchoTask(examples)
    settings = dict(gen_length=8, block_length=4, steps=4)
    whole = evaluate(model, tokenizer, task, **settings)
    split = evaluate(model, tokenizer, task, batch_size=2, **settings)
    assert whole.num_examples == 5 and whole.completions == split.completions
    # The same completions as generate() on each prompt alone (padding must not leak into the batch).
    for example, completion in zip(examples, whole.completions):
        ids, _ = encode_prompts(tokenizer, [task.prompt(example, tokenizer)])
        alone = generate(model, ids, gen_length=8, block_length=4, steps=4)
        assert decode_completions(tokenizer, alone) == [completion]
    assert whole.rewards == [task.reward(e, c) for e, c in zip(examples, whole.completions)]
    # A task whose answers are the model's own greedy completions is solved exactly.
    oracle = EchoTask([Example(question=e.question, answer=c) for e, c in zip(examples, whole.completions)])
    scored = evaluate(model, tokenizer, oracle, **settings)
    assert scored.accuracy == 1.0 and scored.correct == [True] * 5
    assert evaluate(model, tokenizer, oracle, examples=oracle.examples[:2], **settings).num_examples == 2


def test_evaluate_restores_training_mode_and_samples_reproducibly(one_thread, tokenizer, model):
    task = EchoTask([Example(question="12", answer="1"), Example(question="3", answer="2")])
    model.train()
    first = evaluate(model, tokenizer, task, gen_length=4, block_length=4, steps=4, temperature=1.0, seed=5)
    assert model.training
    again = evaluate(model, tokenizer, task, gen_length=4, block_length=4, steps=4, temperature=1.0, seed=5)
    assert first.completions == again.completions
    model.eval()
    with pytest.raises(ValueError, match="no examples to evaluate echo"):
        evaluate(model, tokenizer, task, examples=[], gen_length=4, block_length=4, steps=4)
