"""SME time: choose the few items worth an expert's review, and a page to review them.

- :mod:`calibrl.sme.items`: the sample-input format (rollouts / eval outputs) and its reader;
- :mod:`calibrl.sme.sample`: representative sampling (``calibrl sme sample``);
- :mod:`calibrl.sme.store`: the feedback JSONL the review page writes, atomically;
- :mod:`calibrl.sme.agreement`: agreement between reviewers (Cohen's kappa);
- :mod:`calibrl.sme.app`: the review web app (``calibrl sme review``);
- the demo's expert-time study (kappa vs number of reviews) uses these, and lives with the
  other experiments: :mod:`calibrl.studies.sme_time`.
"""
