"""Errors the services report to callers, each with its gRPC status (`status`, a grpc.StatusCode; `code`, its number
in google.rpc.Code numbering)."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    status = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def code(self) -> int:
        return self.status.value[0]


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


class Unauthenticated(ServiceError):
    status = grpc.StatusCode.UNAUTHENTICATED
