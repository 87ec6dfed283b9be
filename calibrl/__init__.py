"""calibrl: SME-calibrated rewards and calibrated GRPO for retrieval agents.

What a user imports::

    from calibrl import Retriever, Judge, JudgeConfig                 # the two cores, in process
    from calibrl import GrpcRetrievalClient, GrpcJudgeClient          # reward clients of the services
    from calibrl import InProcessRetrievalClient, InProcessJudgeClient  # the same, without a network
    from calibrl import TrainConfig, load_train_config, train         # the trainer
    from calibrl import RewardConfig, load_tasks                      # its reward and its task files
    from calibrl import make_reward_funcs, tasks_to_dataset           # calibrl's rewards in TRL's GRPOTrainer

    from calibrl import Task, TaskKind, register_task_kind            # extension points: a new task kind,
    from calibrl import AdvantageInputs, register_advantage           # a new advantage estimator

Everything is imported on first use, so ``import calibrl`` (and ``calibrl --help``)
loads neither torch nor faiss. The distribution installs one package, ``calibrl``:

- ``calibrl``                  shared core: the types both sides of a service share and their
                               wire conversions (``calibrl.api``, over the generated code
                               ``calibrl.v1``), errors, config loading, gRPC serving, batching,
                               text normalisation, devices, the ``calibrl`` CLI, the embedded
                               demo (``calibrl.demo``) and the helpers of tests and benchmarks
                               (``calibrl.testing``);
- ``calibrl.retrieval_server`` the fixed index and its reward signals, served over gRPC
                               (source folder ``retrieval_server/``);
- ``calibrl.judge_server``     rubric judges served over gRPC; its ``authoring`` half distils
                               SME grades into rubrics and judge models (``judge_server/``);
- ``calibrl.trainer``          the GRPO / CalibAdv trainer, a client of both services, with
                               the built-in task kinds in ``calibrl.trainer.kinds``
                               (``trainer/``).

The errors every part raises on purpose are in ``calibrl.errors`` (``CalibrlError``
and its subclasses), exported here too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Retriever": "calibrl.retrieval_server.retriever",
    "RetrievalServerConfig": "calibrl.retrieval_server.config",
    "Judge": "calibrl.judge_server.judge",
    "JudgeConfig": "calibrl.api.judge_config",
    "JudgeServerConfig": "calibrl.judge_server.config",
    "RetrievalClient": "calibrl.trainer.clients",
    "JudgeClient": "calibrl.trainer.clients",
    "GrpcRetrievalClient": "calibrl.trainer.grpc_clients",
    "GrpcJudgeClient": "calibrl.trainer.grpc_clients",
    "InProcessRetrievalClient": "calibrl.trainer.inprocess",
    "InProcessJudgeClient": "calibrl.trainer.inprocess",
    "RewardModel": "calibrl.trainer.rewards",
    "RewardConfig": "calibrl.trainer.rewards",
    "load_tasks": "calibrl.trainer.tasks",
    "make_reward_funcs": "calibrl.trainer.trl_adapter",
    "tasks_to_dataset": "calibrl.trainer.trl_adapter",
    "TrainConfig": "calibrl.trainer.config",
    "load_train_config": "calibrl.trainer.config",
    "train": "calibrl.trainer.loop",
    "TrainResult": "calibrl.trainer.loop",
    "Task": "calibrl.trainer.tasks",
    "TaskKind": "calibrl.trainer.task_kinds",
    "register_task_kind": "calibrl.trainer.task_kinds",
    "AdvantageInputs": "calibrl.trainer.advantages",
    "register_advantage": "calibrl.trainer.advantages",
    "CalibrlError": "calibrl.errors",
    "ConfigError": "calibrl.errors",
    "InvalidArgument": "calibrl.errors",
    "RewardError": "calibrl.errors",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.errors import CalibrlError, ConfigError, InvalidArgument, RewardError
    from calibrl.api.judge_config import JudgeConfig
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.judge_server.judge import Judge
    from calibrl.retrieval_server.config import RetrievalServerConfig
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.trainer.clients import JudgeClient, RetrievalClient
    from calibrl.trainer.config import TrainConfig, load_train_config
    from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
    from calibrl.trainer.inprocess import InProcessJudgeClient, InProcessRetrievalClient
    from calibrl.trainer.loop import TrainResult, train
    from calibrl.trainer.rewards import RewardConfig, RewardModel
    from calibrl.trainer.tasks import load_tasks
    from calibrl.trainer.trl_adapter import make_reward_funcs, tasks_to_dataset
    from calibrl.trainer.advantages import AdvantageInputs, register_advantage
    from calibrl.trainer.task_kinds import TaskKind, register_task_kind
    from calibrl.trainer.tasks import Task


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'calibrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
