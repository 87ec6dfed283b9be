"""The GRPO / CalibAdv trainer: a thin client of the retrieval and judge services
that owns the policy and the update.

A step flows through one module per stage: ``sampling`` (tasks -> rollouts, scoring
started) -> ``scoring`` (rewards) -> ``training_batch`` (per-token advantages from the
``advantages`` registry) -> ``update`` (loss, optimizer); ``loop.train`` runs the steps.
``task_kinds`` registers the agents (rewrite, search). See docs/design.md."""
