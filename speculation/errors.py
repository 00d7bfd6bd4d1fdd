"""Errors the services report to callers, each with its gRPC status (grpc.StatusCode: `code` in google.rpc.Code
numbering, `code_name` as the status is named)."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    status = grpc.StatusCode.INTERNAL
    code: int
    code_name: str

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls.code, cls.code_name = cls.status.value[0], cls.status.name

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


ServiceError.code, ServiceError.code_name = ServiceError.status.value[0], ServiceError.status.name


class InvalidArgument(ServiceError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(ServiceError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(ServiceError):
    status = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ServiceError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    status = grpc.StatusCode.UNAVAILABLE
