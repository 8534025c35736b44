"""gRPC server reflection (grpc.reflection.v1 and v1alpha) over the descriptors in POOL, for grpcurl and friends.

Each request on the stream is answered in turn: the list of services, or a file (by name, or the one
defining a symbol) with every file it imports, as serialized FileDescriptorProtos. proto3 files have
no extensions, so extension questions are answered NOT_FOUND as grpcio-reflection does for them.
"""

from collections.abc import AsyncIterator

import grpc
from google.protobuf import descriptor_pb2, message

from gepool.grpc import reflection_pb2 as pb
from gepool.grpc.descriptors import POOL

SERVICE_NAMES = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")
_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _files(file) -> list[bytes]:
    """The file and everything it imports, transitively, each once, the file first."""
    out, seen, todo = [], set(), [file]
    while todo:
        f = todo.pop(0)
        if f.name in seen:
            continue
        seen.add(f.name)
        proto = descriptor_pb2.FileDescriptorProto()
        f.CopyToProto(proto)
        out.append(proto.SerializeToString())
        todo.extend(f.dependencies)
    return out


class Reflection:
    def __init__(self, services: list[str]) -> None:
        self.services = [*services, *SERVICE_NAMES]

    def answer(self, request: pb.ServerReflectionRequest) -> pb.ServerReflectionResponse:
        out = pb.ServerReflectionResponse(valid_host=request.host, original_request=request)
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                out.list_services_response.service.extend(pb.ServiceResponse(name=s) for s in self.services)
            elif kind == "file_by_filename":
                out.file_descriptor_response.file_descriptor_proto.extend(
                    _files(POOL.FindFileByName(request.file_by_filename)))
            elif kind == "file_containing_symbol":
                out.file_descriptor_response.file_descriptor_proto.extend(
                    _files(POOL.FindFileContainingSymbol(request.file_containing_symbol)))
            elif kind == "all_extension_numbers_of_type":
                POOL.FindMessageTypeByName(request.all_extension_numbers_of_type)
                out.all_extension_numbers_response.base_type_name = request.all_extension_numbers_of_type
            elif kind == "file_containing_extension":
                raise KeyError(request.file_containing_extension.containing_type)
            else:
                out.error_response.error_code, out.error_response.error_message = _INVALID, "empty request"
        except KeyError:
            out.error_response.error_code, out.error_response.error_message = _NOT_FOUND, "not found"
        return out

    async def info(self, raw_requests, context) -> AsyncIterator[pb.ServerReflectionResponse]:
        async for raw in raw_requests:
            try:
                request = pb.ServerReflectionRequest.FromString(raw)
            except message.DecodeError as exc:
                yield pb.ServerReflectionResponse(error_response=pb.ErrorResponse(
                    error_code=_INVALID, error_message=f"malformed ServerReflectionRequest: {exc}"))
                continue
            yield self.answer(request)

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's one method, for each of SERVICE_NAMES."""
        return {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            self.info, request_deserializer=None, response_serializer=pb.ServerReflectionResponse.SerializeToString)}
