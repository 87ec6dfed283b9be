"""protobuf <-> dataclass translation for the judge service, used by both the
servicer and the trainer's gRPC client."""

from __future__ import annotations

from calibrl.v1 import judge_pb2 as pb
from calibrl.api.judge import CriterionScore, ItemScore, JudgeItem


def item_to_proto(item: JudgeItem) -> pb.JudgeItem:
    return pb.JudgeItem(
        query=item.query,
        output=item.output,
        retrieved_texts=list(item.retrieved_texts),
        retrieved_doc_ids=list(item.retrieved_doc_ids),
        context=dict(item.context),
    )


def item_from_proto(message: pb.JudgeItem) -> JudgeItem:
    return JudgeItem.make(
        query=message.query,
        output=message.output,
        retrieved_texts=message.retrieved_texts,
        retrieved_doc_ids=message.retrieved_doc_ids,
        context=dict(message.context),
    )


def item_score_to_proto(score: ItemScore) -> pb.ItemScore:
    return pb.ItemScore(
        criteria=[
            pb.CriterionScore(name=c.name, score=c.score, weight=c.weight, penalty=c.penalty) for c in score.criteria
        ],
        total=score.total,
        cached=score.cached,
    )


def item_score_from_proto(message: pb.ItemScore, rubric_id: str, rubric_hash: str, model_id: str) -> ItemScore:
    return ItemScore(
        criteria=tuple(
            CriterionScore(name=c.name, score=c.score, weight=c.weight, penalty=c.penalty) for c in message.criteria
        ),
        total=message.total,
        rubric_id=rubric_id,
        rubric_hash=rubric_hash,
        model_id=model_id,
        cached=message.cached,
    )
