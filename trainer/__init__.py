"""The GRPO / CalibAdv trainer: a thin client of the retrieval and judge services
that owns the policy and the update.

A step flows through one module per stage: ``sampling`` (tasks -> rollouts, scoring
started) -> ``scoring`` (rewards) -> ``training_batch`` (per-token advantages from the
``advantages`` registry) -> ``update`` (loss, optimizer); ``loop.train`` runs the steps.
``task_kinds`` is the registry of agents (``builtin_kinds``: rewrite, search); a new
kind is one module calling ``register_task_kind``. See docs/design.md."""
