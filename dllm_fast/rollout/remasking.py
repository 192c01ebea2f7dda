"""Remasking rules: how a denoising step ranks the still-masked positions of the block it may unmask."""

from __future__ import annotations

import torch

from dllm_fast.validation import check_choice


class Remasking:
    """How a step ranks the still-masked positions of the block: the highest scores are unmasked first.

    A rule is `scores`. A rule that draws random numbers also splits it in two, so that the denoising step, which
    torch.compile captures whole, never calls a generator: `draw` (before the step, eagerly) and `rank` (inside
    it). The defaults fit a rule without randomness: `draw` draws nothing and `rank` calls `scores`.
    """

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

    def draw(self, fed_shape: tuple[int, int], generator, device) -> torch.Tensor | None:
        """The random numbers a step's `rank` uses, drawn from `generator` before the step (None: none)."""
        return None

    def rank(self, confidence: torch.Tensor | None, drawn: torch.Tensor | None, *, fed_shape: tuple[int, int],
             fed_positions, device) -> torch.Tensor:
        """`scores` from what `draw` drew, without touching a generator."""
        return self.scores(confidence, fed_shape=fed_shape, fed_positions=fed_positions, generator=None,
                           device=device)

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
        return self.rank(confidence, self.draw(fed_shape, generator, device), fed_shape=fed_shape,
                         fed_positions=fed_positions, device=device)

    def draw(self, fed_shape, generator, device):
        return torch.rand(fed_shape, device=device, generator=generator)

    def rank(self, confidence, drawn, *, fed_shape, fed_positions, device):
        return drawn if fed_positions is None else drawn.gather(1, fed_positions)


REMASKING: dict[str, Remasking] = {rule.name: rule for rule in (LowConfidence(), RandomRemasking())}


def remasking_rule(remasking) -> Remasking:
    """A Remasking instance, or the one registered under the name `remasking`."""
    if isinstance(remasking, Remasking):
        return remasking
    return REMASKING[check_choice("remasking", remasking, REMASKING)]


