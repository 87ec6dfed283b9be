"""The GRPO / CalibAdv trainer: a thin client of the retrieval and judge services
that owns the policy and the update."""
