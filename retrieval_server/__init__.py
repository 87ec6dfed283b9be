"""The retrieval service: a fixed, prebuilt index and the reward signals of a query.

Public surface: :class:`calibrl.api.retrieval.Hit`, ``ScoreItem``,
``RetrievalScore``, ``SearchMode`` (plain dataclasses shared with the trainer's
clients) and the core ``Retriever`` (``search()``, ``score()``), which the gRPC
servicer only adapts.
"""
