"""DiffusionGRPOTrainer end to end on CPU in seconds: a tiny random LLaDA model, a word-level tokenizer built
offline, and a toy reward (the fraction of completion words from the first half of the vocabulary).

    python -m dllm_fast.integrations.trl_example                      # 2 steps of diffu_grpo
    python -m dllm_fast.integrations.trl_example --objective espo --steps 4 --output-dir /tmp/trl-espo

Swap in a real model and tokenizer (LLaDAModel.from_pretrained / HFDiffusionLM.from_pretrained and
AutoTokenizer.from_pretrained of the same directory), a real dataset with a "prompt" column and real rewards.
Needs the optional extra: pip install "dllm_fast[trl]".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.x

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from dllm_fast import objectives  # noqa: E402
from dllm_fast.integrations.trl import DiffusionGRPOTrainer, make_rollout_func  # noqa: E402
from dllm_fast.models import LLaDAConfig, LLaDAModel  # noqa: E402
from dllm_fast.validation import check_int  # noqa: E402

WORDS = [f"a{i}" for i in range(62)] + [f"b{i}" for i in range(62, 124)]  # ids 0..123


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over LLaDA's "tiny" preset vocabulary: 124 words, then <|eot_id|> 125, <|endoftext|> 126 (EOS
    and padding), <|mdm_mask|> 127."""
    vocab = {word: i for i, word in enumerate(WORDS)}
    vocab.update({"<|eot_id|>": 125, "<|endoftext|>": 126, "<|mdm_mask|>": 127})
    vocab["<unk>"] = 124
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|mdm_mask|>")


def a_words_reward(completions: list[str], **kwargs) -> list[float]:
    """The fraction of the completion's words that start with "a" (a toy task a policy can learn)."""
    return [sum(word.startswith("a") for word in text.split()) / max(1, len(text.split())) for text in completions]


def build_trainer(output_dir: str, *, objective: str = "diffu_grpo", steps: int = 2, seed: int = 0, peft_config=None,
                  reward_funcs=None, **config) -> DiffusionGRPOTrainer:
    """The example's trainer; `config` overrides GRPOConfig fields."""
    check_int("steps", steps, minimum=1, hint="optimizer steps")  # GRPOConfig reads max_steps <= 0 as "by epochs"
    torch.manual_seed(seed)
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    prompts = ["a1 b70 a5", "b99 b64", "a10 a11 a12 b100", "b80"]
    options = dict(output_dir=output_dir, max_steps=steps, num_generations=4, per_device_train_batch_size=8,
                   gradient_accumulation_steps=1, max_completion_length=8, learning_rate=1e-3, temperature=1.0,
                   logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=seed,
                   dataloader_num_workers=0, **activation_checkpointing(True))
    options.update(config)
    return DiffusionGRPOTrainer(
        model=model, reward_funcs=reward_funcs or [a_words_reward], args=GRPOConfig(**options),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=build_tokenizer(),
        objective=objective, rollout_func=make_rollout_func(block_length=4, steps=8, seed=seed),
        peft_config=peft_config)


def activation_checkpointing(enabled: bool) -> dict:
    """The GRPOConfig option that recomputes activations in backward, by its current name (transformers 5 renamed
    gradient_checkpointing to activation_checkpointing and warns on the old one)."""
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": enabled}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objective", default="diffu_grpo", choices=objectives.available())
    parser.add_argument("--steps", type=_positive_int, default=2, help="optimizer steps, at least 1 (default: 2)")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(args.output_dir or scratch, objective=args.objective, steps=args.steps)
        trainer.train()
    for row in trainer.state.log_history:
        if "loss" in row:
            print(f"step {row['step']}: loss {row['loss']:.4f}  reward {row.get('reward', float('nan')):.3f}  "
                  f"grad_norm {row.get('grad_norm', float('nan')):.4f}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {text!r}")
    return value


if __name__ == "__main__":
    main()
