"""The built-in task kinds, one module each; importing this package registers them.

- :mod:`calibrl.trainer.kinds.rewrite`: ``rewrite``, a one-step query rewriter;
- :mod:`calibrl.trainer.kinds.search`: ``search``, a multi-step Search-R1 agent.

A kind is everything that differs between agents (:class:`~calibrl.trainer.task_kinds.TaskKind`):
its records, prompt, rollout, reward, held-out metrics, step metrics, SME items and task file
format. A new kind is one module like these calling
:func:`~calibrl.trainer.task_kinds.register_task_kind`; nothing else in the trainer changes.
"""

from __future__ import annotations

from calibrl.trainer.kinds import rewrite, search  # noqa: F401 - imported to register the kinds

__all__ = ["rewrite", "search"]
