"""Which rollouts a step trains on, on-policy or one step off-policy.

On-policy (``rollout.off_policy_steps=0``) a step samples its own rollouts. One
step off-policy (``=1``) a step also samples the next step's rollouts before its
update, so their scoring runs behind the rest of this step and the next step's
forward passes; the next step then trains on them with their behaviour log-probs
(``PendingBatch.behaviour_logp``, the loss's ``old_logp``). :class:`RolloutPipeline` keeps
that one batch in between.
"""

from __future__ import annotations

from calibrl.errors import CalibrlError
from calibrl.trainer.sampling import RolloutSampler
from calibrl.trainer.handoff import PendingBatch, StepRollouts


class RolloutPipeline:
    """Hands each step its rollouts, sampled now or in the previous step."""

    def __init__(self, sampler: RolloutSampler, off_policy_steps: int, last_step: int,
                 pending: PendingBatch | None = None) -> None:
        self.sampler, self.off_policy_steps, self.last_step = sampler, off_policy_steps, last_step
        self.pending = pending  # rollouts sampled for the next step, not yet trained on

    def take(self, step: int) -> StepRollouts:
        """This step's rollouts and, off-policy, the next step's (their scoring already submitted)."""
        current, upcoming, failure = self.pending, None, None
        self.pending = None
        try:
            if current is None:
                current = self.sampler.sample(step)
            if self.off_policy_steps and step < self.last_step:
                upcoming = self.sampler.sample(step + 1)
        except CalibrlError as exc:
            failure = exc
        return StepRollouts(current, upcoming, failure)

    def keep(self, upcoming: PendingBatch | None) -> None:
        """After the update: ``upcoming`` is what the next step trains on."""
        self.pending = upcoming


__all__ = ["RolloutPipeline", "StepRollouts"]
