"""The GRPO / CalibAdv trainer: a thin client of the retrieval and judge services
that owns the policy and the update.

A step flows through one module per stage: ``sampling`` (tasks -> rollouts, scoring
started) -> ``scoring`` (rewards) -> ``training_batch`` (per-token advantages from the
``advantages`` registry) -> ``update`` (loss, optimizer); ``loop.train`` runs the steps.
``task_kinds`` is the registry of agents and ``kinds`` holds the built-in ones, one
package each (rewrite, search); a new kind is one module calling ``register_task_kind``.
See docs/design.md.

Importing this package registers the built-in kinds (none of them imports torch).
"""

from calibrl.trainer import kinds as _kinds  # noqa: F401 - registers the built-in task kinds
