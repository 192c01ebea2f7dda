"""The embedded defaults: two tiny models fine-tuned on sudoku4, shipped inside the package.

- `sudoku4/` (`--model sudoku4`, the trainer's default): a LLaDA-architecture model (bidirectional attention);
- `sdar_sudoku4/` (`--model sdar-sudoku4`): an SDAR-architecture block-diffusion model (block-causal attention in
  blocks of 4), for the objectives that need a block model (EBPO, the block ELBO).

Each holds the official checkpoint layout of its family (config.json, model.safetensors, tokenizer.json and
tokenizer_config.json with LLaDA's chat template: both share the character tokenizer) and build_sudoku4.json (how
it was built, its accuracy curve). `python -m dllm_fast.build_sudoku4 --out DIR [--architecture sdar]` rebuilds
either from scratch, deterministically, on CPU; its docstring says why half of the fine-tuning demonstrations
come from a careless solver. The settings below are the ones they were built and evaluated with.
"""

from __future__ import annotations

from pathlib import Path

SUDOKU4_DIR = Path(__file__).resolve().parent / "sudoku4"
# get_task("sudoku4", **SUDOKU4_TASK_OPTIONS) is the task the model was fine-tuned on.
SUDOKU4_TASK_OPTIONS = {"prompt_style": "grid"}
# Greedy evaluation settings, and the rollout settings with SUDOKU4_ROLLOUT_TEMPERATURE: one block of 24 tokens
# (<answer>, 4 rows of 4 digits, </answer>, end of turn, EOS), two tokens unmasked per step.
SUDOKU4_GENERATION = {"gen_length": 24, "block_length": 24, "steps": 12}
# At T = 1, about 90% of groups of 8 rollouts of a training puzzle differ in reward.
SUDOKU4_ROLLOUT_TEMPERATURE = 1.0

SDAR_SUDOKU4_DIR = Path(__file__).resolve().parent / "sdar_sudoku4"
# The SDAR model's greedy evaluation settings: its own blocks of 4 (the first holds the prompt's last 3 tokens),
# two tokens a step, the exact block cache.
SDAR_SUDOKU4_GENERATION = {"gen_length": 24, "block_length": 4, "steps": 12, "cache": "block"}
# The embedded models by their --model names (each fine-tuned on get_task("sudoku4", **SUDOKU4_TASK_OPTIONS)).
EMBEDDED_MODELS = {"sudoku4": SUDOKU4_DIR, "sdar-sudoku4": SDAR_SUDOKU4_DIR}


def load_sudoku4(directory: str | Path = SUDOKU4_DIR, dtype=None, device=None):
    """(model, tokenizer, task): an embedded model (the LLaDAModel by default; `SDAR_SUDOKU4_DIR` for the
    SDARModel), its tokenizer and the sudoku4 task it was trained on."""
    # AutoTokenizer loads it too, but first reads config.json and warns that it knows no "llada" model type.
    from transformers import PreTrainedTokenizerFast

    from dllm_fast.models.loading import model_class
    from dllm_fast.tasks import get_task

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        sdar = " --architecture sdar" if directory.name == SDAR_SUDOKU4_DIR.name else ""
        raise FileNotFoundError(f"{directory} holds no config.json; rebuild the embedded model with "
                                f"`python -m dllm_fast.build_sudoku4 --out {directory}{sdar}`.")
    model = model_class(directory).from_pretrained(directory, dtype=dtype, device=device)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    return model, tokenizer, get_task("sudoku4", **SUDOKU4_TASK_OPTIONS)
