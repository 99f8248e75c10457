"""The KServe v2 gRPC messages (package `inference`), built from Triton's protos at import.

The descriptors (`descriptors.py`, compiled from the protos by `regenerate.py`) are loaded into
a descriptor pool of Kiln's own, not protobuf's default one, and the message classes made from
it. Two reasons, both met in practice:

- tritonclient's `service_pb2`/`model_config_pb2` register the same files and the same
  `inference.*` names in the default pool; a process importing both (a test, `kiln.deploy`,
  which reads Triton's `model_config_pb2`) would fail with "duplicate file name" as soon as the
  two copies of the protos differ by a field.
- protoc's generated modules refuse a protobuf runtime older than the protoc that wrote them
  and warn or fail across majors; a serialized descriptor has no such check, so Kiln runs on
  the protobuf 6 that `tritonclient[grpc]` pins as on the protobuf 7 that onnx brings.

The wire format is the protos', so any KServe v2 client (tritonclient.grpc unchanged) talks to
messages built here.
"""

from __future__ import annotations

import functools

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from kiln.serve._proto.descriptors import GRPC_SERVICE, MODEL_CONFIG

PACKAGE = "inference"
SERVICE_NAME = f"{PACKAGE}.GRPCInferenceService"

_POOL = descriptor_pool.DescriptorPool()
for _serialized in (MODEL_CONFIG, GRPC_SERVICE):  # a file's dependencies first
    _POOL.AddSerializedFile(_serialized)


@functools.cache
def message(name: str) -> type[Message]:
    """The class of message `inference.NAME`, e.g. message("ModelInferRequest")."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


def service() -> ServiceDescriptor:
    """GRPCInferenceService: its methods, with their input and output message types."""
    return _POOL.FindServiceByName(SERVICE_NAME)
