"""gRPC server reflection under both protocol names, v1 and v1alpha.

grpcio-reflection ships only ``grpc.reflection.v1alpha``; current clients
(grpcurl, Postman, grpc-js tools) ask ``grpc.reflection.v1`` first. The two
protocols have the same messages with the same field numbers, only the package
differs, so the v1 service is the v1alpha servicer behind the v1 method name,
and the v1 file descriptor (the v1alpha one with its package renamed) is added
to the default pool so that a client can describe the v1 service too.
"""

from __future__ import annotations

from typing import Any, Iterable

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2 as alpha

    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for message_field in message.field:
            if message_field.type_name.startswith(old):
                message_field.type_name = new + message_field.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    pool.AddSerializedFile(proto.SerializeToString())


def enable(server: Any, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) on a grpc.aio ``server`` for ``service_names``."""
    import grpc
    from grpc_reflection.v1alpha import _async
    from grpc_reflection.v1alpha import reflection as alpha_reflection
    from grpc_reflection.v1alpha import reflection_pb2 as alpha
    from grpc_reflection.v1alpha import reflection_pb2_grpc as alpha_grpc

    _register_v1_descriptor()
    servicer = _async.ReflectionServicer([*service_names, alpha_reflection.SERVICE_NAME, V1_SERVICE])
    alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    # same wire format, so the v1alpha message classes (de)serialise v1 messages
    v1_handler = grpc.method_handlers_generic_handler(V1_SERVICE, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=alpha.ServerReflectionRequest.FromString,
            response_serializer=alpha.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((v1_handler,))
