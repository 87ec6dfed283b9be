"""The judge service: rubrics distilled from SME grades, validated against a
golden set, executed by programmatic, transformers or vLLM judges, served over gRPC.

Public surface (everything else is an implementation detail):

- ``calibrl.judge_server.judge.Judge``: the core, ``score(rubric_id, items, tenant=None)``;
  ``Judge.from_config(JudgeConfig, rubrics_dir)``.
- ``calibrl.judge_server.config``: ``JudgeConfig`` (in process) and ``JudgeServerConfig``.
- ``calibrl.judge_server.server.start(config) -> RunningServer``: the gRPC server on the
  current event loop.
- ``calibrl.judge_server.rubric``: the rubric file format, ``load_rubric``, ``Rubric.hash``.
- ``calibrl.judge_server.authoring.feedback``, ``calibrl.judge_server.authoring.distill``, ``calibrl.judge_server.authoring.validation``:
  SME feedback records, distillation, validation records and the gate.
- ``calibrl.judge_server.cli``: ``calibrl serve judge``, ``calibrl rubric distill|validate``.

Test helpers (a tiny causal LM, synthetic SME feedback) live in ``calibrl.testing``.

Module map: ``programmatic`` + ``entities`` + ``calibrl.embedding`` (criteria without an LLM),
``prompts`` + ``backends/encoding`` (prompt and score code shared by the LLM backends),
``backends/hf`` (transformers), ``backends/vllm_backend`` (vLLM), ``metrics``
(agreement statistics), ``cache`` (result cache), ``rubric_store`` (rubric versions: pins, live reloads,
retention and retirement).
"""
