"""Errors the services report to callers, each with its gRPC status code (google.rpc.Code numbering)."""

from __future__ import annotations


class ServiceError(Exception):
    code = 13  # INTERNAL
    code_name = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code, code_name = 3, "INVALID_ARGUMENT"


class DeadlineExceeded(ServiceError):
    code, code_name = 4, "DEADLINE_EXCEEDED"


class NotFound(ServiceError):
    code, code_name = 5, "NOT_FOUND"


class ResourceExhausted(ServiceError):
    code, code_name = 8, "RESOURCE_EXHAUSTED"


class FailedPrecondition(ServiceError):
    code, code_name = 9, "FAILED_PRECONDITION"


class Unavailable(ServiceError):
    code, code_name = 14, "UNAVAILABLE"
