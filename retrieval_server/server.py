"""Start the retrieval service on grpc.aio (health, reflection and SIGTERM drain come
from calibrl.serving).

In tests and in other components' tests::

    running = await calibrl.retrieval_server.server.start(config)        # port 0 -> running.port
    channel = grpc.aio.insecure_channel(running.address)
    ...
    await running.stop(grace=1.0)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from calibrl.batching import MicroBatcher
from calibrl.config import validate
from calibrl.security import tenant_weights
from calibrl.threads import call_nicer
from calibrl.serving import (BATCHER_CLOSE_S, RunningServer, freeze_loaded_objects, serve_until_signal, start_server,
                             stop_on_signals)
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.retrieval_server.config import RetrievalServerConfig
from calibrl.retrieval_server.retriever import Retriever
from calibrl.retrieval_server.servicer import SERVICE_NAME, RetrievalServicer, answer_batch

log = logging.getLogger(__name__)


@dataclass
class RunningRetrievalServer(RunningServer):
    """A started retrieval server; also exposes its retriever and batcher (stats)."""

    host: str = "127.0.0.1"
    retriever: Any = None
    batcher: Any = None

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"


def warm_up(retriever: Retriever) -> None:
    """Rank a probe query in every mode, so every model is loaded before health says SERVING."""
    for mode in retriever.modes:
        Retriever.ranked(retriever, ["probe query"], 1, mode)  # the library's ranking, not a subclass's


async def start(config: RetrievalServerConfig, retriever: Retriever | None = None) -> RunningRetrievalServer:
    """Load the index (unless ``retriever`` is given) and serve it in the running event loop.

    With ``config.serving.port = 0`` a free port is chosen: read it from ``.port``.
    """
    validate(config)
    if retriever is None:
        # models load at the workers' niceness (calibrl.threads.call_nicer)
        retriever = await asyncio.to_thread(call_nicer, config.serving.compute_nice, Retriever.from_config, config)
    batcher: MicroBatcher = MicroBatcher(
        lambda mode, work: answer_batch(retriever, mode, work),
        max_batch_items=config.batch_max_items,
        max_queue_items=config.batch_max_queue_items,
        max_wait_ms=config.batch_max_wait_ms,
        max_batch_cost=config.serving.max_unit_cost_s,
        max_tenant_queue_cost=config.serving.max_tenant_queue_cost_s,
        short_item_cost=config.serving.short_item_cost_s,
        worker_nice=config.serving.compute_nice,
        weights=tenant_weights(config.serving.api_keys_file),
        name="retrieval",
    )
    servicer = RetrievalServicer(retriever, batcher, int(config.serving.max_request_mb * 1024 * 1024))
    running = await start_server(
        config.serving,
        lambda server: pb_grpc.add_RetrievalServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        on_no_new_calls=[batcher.end_windows],
        on_stop=[lambda: batcher.close(timeout_s=BATCHER_CLOSE_S)],
        warm_up=lambda: asyncio.to_thread(call_nicer, config.serving.compute_nice, warm_up, retriever),
    )
    base = {f.name: getattr(running, f.name) for f in dataclasses.fields(RunningServer)}
    return RunningRetrievalServer(**base, host=config.serving.host, retriever=retriever, batcher=batcher)


async def serve(config: RetrievalServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain and stop (the entry point of a server process:
    it ends the process if the shutdown overruns drain + grace, see :func:`serve_until_signal`)."""
    if config.torch_threads:
        import torch

        # a process-wide setting, so only here and not in start(): with more compute threads
        # than free cores (a shared host), every parallel region of the encoder can stall
        torch.set_num_threads(config.torch_threads)
    stop_requested = stop_on_signals()  # before the port is announced: a SIGTERM from then on drains
    running = await start(config)
    freeze_loaded_objects()
    log.info(
        "retrieval index %s: %d passages, dense %s, default mode %s",
        config.index_dir, running.retriever.doc_count, running.retriever.dense_index_type,
        running.retriever.default_mode.value,
    )
    print(f"retrieval server listening on {config.serving.host}:{running.port}", flush=True)
    await serve_until_signal(running, config.serving.grace_seconds, stop_requested, exit_watchdog=True)
