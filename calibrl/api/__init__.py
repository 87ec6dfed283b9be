"""The types both sides of a service share: what a caller sends, what it gets back, and the
conversions to and from the wire (the generated protobuf code in :mod:`calibrl.v1`).

- :mod:`calibrl.api.retrieval`: ``ScoreItem``, ``RetrievalScore``, ``Hit``, ``SearchMode``;
  :mod:`calibrl.api.retrieval_wire` converts them to and from ``calibrl.v1.retrieval_pb2``.
- :mod:`calibrl.api.judge`: ``JudgeItem``, ``ItemScore``, ``CriterionScore``, ``aggregate``;
  :mod:`calibrl.api.judge_wire` converts them to and from ``calibrl.v1.judge_pb2``;
  :mod:`calibrl.api.judge_config` is the configuration of a judge core.

The servers (``calibrl.retrieval_server``, ``calibrl.judge_server``) and the trainer's clients
both import from here, so the trainer needs no server package to talk to a service.
"""
