"""A character-level tokenizer in LLaDA's conventions, for small models trained from scratch.

Every printable ASCII character (and newline, tab) is one token; the answer/reasoning tags and the chat roles are
single tokens; the special tokens carry LLaDA-8B-Instruct's names and roles (BOS, EOS = padding, the chat headers,
end of turn, mask), and the chat template is LLaDA's. It is built with the `tokenizers` library and saved so that
`transformers.AutoTokenizer.from_pretrained(directory)` loads it offline.

With `vocab_size` above its own, the vocabulary is padded with reserved tokens `<r0>`, `<r1>`, ... (ordinary text
that decoding keeps, never produced by encoding), so that a preset with random weights keeps a real model's output
layer, e.g. LLaDA-8B's 126,464 rows, and what it samples decodes to distinct text:

    python -m dllm_fast.assets.char_tokenizer --vocab-size 126464 --out /tmp/llada_vocab
    python -m dllm_fast train --model llada-8b --tokenizer /tmp/llada_vocab --task synthetic ...
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

BOS, EOS, MASK, UNK = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<unk>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT, MASK, UNK)
# Multi-character tokens that are ordinary text (decoding keeps them).
WORD_TOKENS = ("user", "assistant", "system", "<reasoning>", "</reasoning>", "<answer>", "</answer>")
CHARACTERS = tuple(c for c in string.printable if c not in "\r\x0b\x0c")

# LLaDA-8B-Instruct's template: BOS, then per message a role header and the stripped content ended by <|eot_id|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


OWN_VOCAB_SIZE = len(CHARACTERS + WORD_TOKENS + SPECIAL_TOKENS)


def build_char_tokenizer(model_max_length: int = 512, vocab_size: int = OWN_VOCAB_SIZE):
    """A `transformers.PreTrainedTokenizerFast` over CHARACTERS + WORD_TOKENS + SPECIAL_TOKENS (in that id order),
    then reserved tokens `<r0>` ... up to `vocab_size` ids (the special ids stay the same)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dllm_fast.validation import check_int

    check_int("vocab_size", vocab_size, minimum=OWN_VOCAB_SIZE, hint="the character tokenizer's own ids and more")
    reserved = tuple(f"<r{index}>" for index in range(vocab_size - OWN_VOCAB_SIZE))
    vocab = {token: index for index, token in enumerate(CHARACTERS + WORD_TOKENS + SPECIAL_TOKENS + reserved)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    backend.decoder = decoders.Fuse()  # join characters without spaces
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, normalized=False) for t in WORD_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=EOS, mask_token=MASK, unk_token=UNK,
        additional_special_tokens=[START_HEADER, END_HEADER, EOT], chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """Save with the chat template inside tokenizer_config.json, the generic fast-tokenizer class and the
    special-token list under its 4.x name, so that transformers 4.x and 5.x both load it with AutoTokenizer."""
    directory = Path(directory)
    tokenizer.save_pretrained(str(directory))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = tokenizer.chat_template
    if "extra_special_tokens" in config:  # 5.x's name; both read "additional_special_tokens"
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    template_file = directory / "chat_template.jinja"
    if template_file.exists():
        template_file.unlink()
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def special_token_ids(tokenizer) -> dict[str, int]:
    """The LLaDAConfig fields that name special tokens, read from the tokenizer."""
    return {
        "mask_token_id": tokenizer.convert_tokens_to_ids(MASK),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS),
        "pad_token_id": tokenizer.convert_tokens_to_ids(EOS),
        "eot_token_id": tokenizer.convert_tokens_to_ids(EOT),
    }


def main(argv=None) -> None:
    """`python -m dllm_fast.assets.char_tokenizer --vocab-size N --out DIR`: write the tokenizer to DIR."""
    import argparse

    parser = argparse.ArgumentParser(description="Write the character tokenizer, its vocabulary padded with "
                                                 "reserved tokens to --vocab-size ids.")
    parser.add_argument("--vocab-size", type=int, default=OWN_VOCAB_SIZE,
                        help=f"ids in all (default: its own {OWN_VOCAB_SIZE}; LLaDA-8B's output layer: 126464)")
    parser.add_argument("--out", required=True, help="directory to write (created)")
    args = parser.parse_args(argv)
    save_tokenizer(build_char_tokenizer(vocab_size=args.vocab_size), args.out)
    print(f"wrote a character tokenizer of {args.vocab_size} ids to {args.out}")


if __name__ == "__main__":
    main()
