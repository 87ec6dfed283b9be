"""The embedded default demo: a generated domain, a tiny policy, the whole loop.

- :mod:`calibrl.demo.domain`: the seeded knowledge base of fictional funds and
  accounts (corpus, rewrite tasks, two-search questions, SME feedback, glossary);
- :mod:`calibrl.demo.policy`: the tokenizer and tiny causal LM trained on it, and
  the supervised warm start into a base rewriter / base search agent;
- :mod:`calibrl.demo.report`: the results table, the plots and the Markdown report;
- :mod:`calibrl.demo.cli`: ``calibrl demo``, which runs distil -> validate -> index
  -> both services -> training -> evaluation -> report, as a list of typed stage
  functions: :mod:`calibrl.demo.preparation` (stages 1-5) and
  :mod:`calibrl.demo.training` (stages 6-9), handing frozen dataclasses on;
- :mod:`calibrl.demo.arms`: the training runs as data (name, agent, config overrides,
  labels); :mod:`calibrl.demo.settings`: the full and quick sizes.

Nothing here downloads anything.
"""
