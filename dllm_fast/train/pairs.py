"""The trainer's preference-pair source: a step's batch from stored (prompt, chosen, rejected) pairs instead of
rollouts and rewards, for objectives that train on preferences (`Objective.preference_pairs`: vrpo_dpo).

How it plugs into the loop (train/loop.py, the one branch marked "preference pairs"): `Run.pairs` is a
`PairSource` when the objective trains on pairs (None otherwise); each step takes the next --prompts-per-step
examples of the task (a `tasks.preference.PreferenceTask`: sudoku4_pairs, pairs_jsonl) and calls
`PairSource.step(examples)` where a rollout step would roll out and score. What follows (the inner updates'
plan, the updates, metrics, evaluation, checkpoints) is the rollout path's, unchanged.

Encoding: the prompt is the task's (its chat template), left-padded with EOS; each completion is its text, the
end-of-turn token and EOS up to --gen-length (sft.encode_sft_batch, the same encoding as supervised fine-tuning:
a completion must leave room for one EOS). The batch is `objectives.vrpo_dpo.preference_batch`'s layout: rows 2k
and 2k + 1 the chosen and the rejected completion of prompt k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.contracts import RolloutBatch
from dllm_fast.objectives.vrpo_dpo import preference_batch
from dllm_fast.sft import encode_sft_batch


def check_pairs_task(objective, task, objective_name: str, task_name: str) -> None:
    """An objective that trains on preference pairs needs a preference task, refused before any work."""
    from dllm_fast.tasks.preference import PreferenceTask

    if objective.preference_pairs and not isinstance(task, PreferenceTask):
        raise ValueError(f"--objective {objective_name} trains on preference pairs (a chosen and a rejected "
                         f"completion per prompt), which --task {task_name} does not hold; use --task sudoku4_pairs "
                         "(the embedded default's puzzles), or --task pairs_jsonl --task-options "
                         "'{\"train_path\": \"pairs.jsonl\", \"test_path\": \"test.jsonl\"}' (one {\"prompt\", "
                         "\"chosen\", \"rejected\"} object a line).")


@dataclass
class PairSource:
    """Builds each step's preference batch. task: a PreferenceTask; gen_length: the completions' width (EOS-padded);
    eos_token_id, eot_token_id: the model's."""

    task: object
    tokenizer: object
    gen_length: int
    eos_token_id: int
    eot_token_id: int | None
    device: torch.device

    def step(self, examples) -> tuple[RolloutBatch, list[bool]]:
        """(the batch of these examples' pairs, whether each row's completion is correct by the task: the chosen
        rows and the rejected rows as the task grades them)."""
        prompts = [self.task.prompt(example, self.tokenizer) for example in examples]
        chosen, rejected = zip(*(self.task.pair(example) for example in examples))
        encoded = [self._encode(prompts, list(completions), examples, which)
                   for completions, which in ((chosen, "chosen"), (rejected, "rejected"))]
        prompt_length = encoded[0].prompt_length
        prompt_mask = None if encoded[0].attention_mask is None else encoded[0].attention_mask[:, :prompt_length]
        batch = preference_batch(encoded[0].sequences[:, :prompt_length], encoded[0].sequences[:, prompt_length:],
                                 encoded[1].sequences[:, prompt_length:], eos_token_id=self.eos_token_id,
                                 prompt_attention_mask=prompt_mask)
        correct = [self.task.correct(example, text) for example, pair in zip(examples, zip(chosen, rejected))
                   for text in pair]
        return batch, correct

    def _encode(self, prompts, completions, examples, which: str):
        try:
            return encode_sft_batch(self.tokenizer, prompts, completions, completion_length=self.gen_length,
                                    eos_token_id=self.eos_token_id, eot_token_id=self.eot_token_id,
                                    device=self.device)
        except ValueError as error:
            text = str(error)
            index = int(text.split()[1]) if text.startswith("completion ") else None
            where = "" if index is None else (f" (the {which} completion of "
                                              f"{examples[index].source or repr(examples[index].question[:80])})")
            raise ValueError(f"{text.rstrip('.')}{where}; preference pairs are encoded to --gen-length {self.gen_length} "
                             "tokens: raise --gen-length or shorten the completions.") from None
