"""The experiments run on the demo's domain, apart from the demo's stages (:mod:`calibrl.demo`):

- :mod:`calibrl.studies.search_arms`: ``calibrl study``, the search agent's arms (GRPO,
  CalibAdv with gold and with the authors' silver documents) over several seeds, with
  intervals; its report in :mod:`calibrl.studies.search_arms_report`;
- :mod:`calibrl.studies.sme_time`: the expert-time study (validation kappa vs number of
  SME reviews, representative vs random sampling), which ``calibrl demo`` runs as a stage.

They reuse the demo's stage functions (domain, index, base policies, training) and its
analyses (:mod:`calibrl.demo.error_analysis`, :mod:`calibrl.demo.rewrite_analysis`).
"""
