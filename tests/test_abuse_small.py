"""The smaller defects of issue 10 section 3: `calibrl health` against an mTLS server,
an index folder that honours the umask, reflection v1 beside v1alpha, and
`--no-progress` hiding transformers' "Loading weights" bar."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

from calibrl import healthcheck
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import TINY_CORPUS, build_test_index, start_test_server
from tests.tls_helpers import make_pki


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("abuse-small") / "index")


@pytest.fixture(scope="module")
def retriever(tiny_index):
    return Retriever.load(tiny_index, device="cpu")


async def test_health_presents_a_client_certificate_to_an_mtls_server(tiny_index, retriever, tmp_path, capsys):
    import asyncio

    pki = make_pki(tmp_path)
    running = await start_test_server(
        tiny_index, f"serving.tls_cert_file={pki['server.crt']}", f"serving.tls_key_file={pki['server.key']}",
        f"serving.tls_client_ca_file={pki['ca.crt']}", retriever=retriever,
    )
    try:
        target = f"127.0.0.1:{running.port}"
        mtls = ["--target", target, "--tls-ca", pki["ca.crt"], "--tls-cert", pki["client.crt"],
                "--tls-key", pki["client.key"]]
        assert await asyncio.to_thread(healthcheck.main, mtls) == 0
        assert "SERVING" in capsys.readouterr().out
        # the certificate names localhost and 127.0.0.1; another name is checked only when asked
        named = [*mtls, "--service", "calibrl.v1.RetrievalService", "--tls-server-name", "localhost"]
        assert await asyncio.to_thread(healthcheck.main, named) == 0
        # without the client certificate the handshake is refused: exit 1, not a traceback
        assert await asyncio.to_thread(healthcheck.main, ["--target", target, "--tls-ca", pki["ca.crt"],
                                                          "--timeout", "5"]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        await running.stop(grace=1.0)
    with pytest.raises(SystemExit):
        healthcheck.main(["--tls-ca", pki["ca.crt"], "--tls-cert", pki["client.crt"]])  # key missing


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_index_build_honours_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        out = build_test_index(tmp_path / "index")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(out).st_mode) == mode
    assert stat.S_IMODE(os.stat(out / "manifest.json").st_mode) == 0o666 & ~umask


def _reflection_classes(version: str):
    pool = descriptor_pool.Default()
    request = GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.{version}.ServerReflectionRequest"))
    response = GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.{version}.ServerReflectionResponse"))
    return request, response


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_answers_v1_and_v1alpha(tiny_index, retriever, version):
    running = await start_test_server(tiny_index, retriever=retriever)
    try:
        request_cls, response_cls = _reflection_classes(version)
        async with grpc.aio.insecure_channel(running.address) as channel:
            call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                         request_serializer=request_cls.SerializeToString,
                                         response_deserializer=response_cls.FromString)
            replies = [reply async for reply in call(iter([
                request_cls(list_services=""),
                request_cls(file_containing_symbol="calibrl.v1.RetrievalService"),
                request_cls(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
            ]), timeout=30)]
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"calibrl.v1.RetrievalService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        for reply, package in ((replies[1], "calibrl.v1"), (replies[2], "grpc.reflection.v1")):
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in reply.file_descriptor_response.file_descriptor_proto]
            assert package in {f.package for f in files}
    finally:
        await running.stop(grace=1.0)


@pytest.mark.slow
def test_no_progress_hides_the_loading_weights_bar(tmp_path):
    import json

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in TINY_CORPUS))
    command = [sys.executable, "-m", "calibrl", "index", "build", "--corpus", str(tmp_path), "--out",
               str(tmp_path / "index"), "--device", "cpu", "--encoder-backend", "torch"]  # torch loads weights
    quiet = subprocess.run([*command, "--no-progress"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "Loading weights" not in quiet.stderr and "it/s]" not in quiet.stderr
    shown = subprocess.run([*command, "--overwrite"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "Loading weights" in shown.stderr  # the bar this test is about
