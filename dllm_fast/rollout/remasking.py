"""Remasking rules: how a denoising step ranks the still-masked positions of the block it may unmask."""

from __future__ import annotations

import torch

from dllm_fast.validation import check_choice


class Remasking:
    """How a step ranks the still-masked positions of the block: the highest scores are unmasked first."""

    name = ""
    uses_model_confidence = True  # whether `scores` reads the model's confidence in its sampled tokens

    def scores(self, confidence: torch.Tensor | None, *, fed_shape: tuple[int, int], fed_positions, generator,
               device) -> torch.Tensor:
        """Ranking scores [B, n] of n positions per row.

        confidence: [B, n] the model's probability of each position's sampled token (None when
            uses_model_confidence is False); fed_positions: [B, n] the positions' indices among the
            fed_shape = (B, F) positions the step fed to the model, or None when the n positions are all of
            them; generator: the sampler's torch.Generator.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LowConfidence(Remasking):
    """LLaDA's low_confidence remasking: the most probable sampled tokens are unmasked first."""

    name = "low_confidence"

    def scores(self, confidence, *, fed_shape, fed_positions, generator, device):
        return confidence


class RandomRemasking(Remasking):
    """LLaDA's random remasking: a random order, one uniform drawn per fed position (as in LLaDA's code)."""

    name = "random"
    uses_model_confidence = False

    def scores(self, confidence, *, fed_shape, fed_positions, generator, device):
        uniform = torch.rand(fed_shape, device=device, generator=generator)
        return uniform if fed_positions is None else uniform.gather(1, fed_positions)


REMASKING: dict[str, Remasking] = {rule.name: rule for rule in (LowConfidence(), RandomRemasking())}


def remasking_rule(remasking) -> Remasking:
    """A Remasking instance, or the one registered under the name `remasking`."""
    if isinstance(remasking, Remasking):
        return remasking
    return REMASKING[check_choice("remasking", remasking, REMASKING)]


