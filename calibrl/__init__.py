"""calibrl: SME-calibrated rewards and calibrated GRPO for retrieval agents.

The distribution holds four top-level packages:

- ``calibrl``          shared core: errors, config loading, gRPC serving, batching,
                       text normalisation, the ``calibrl`` CLI, generated wire code
                       (``calibrl.v1``) and the embedded demo (``calibrl.demo``).
- ``retrieval_server`` the fixed index and its reward signals, served over gRPC.
- ``judge_server``     rubric judges distilled from SME grades, served over gRPC.
- ``trainer``          the GRPO / CalibAdv trainer, a client of both services.
"""

__version__ = "0.1.0"
