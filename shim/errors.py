"""Typed errors of podshim's own operations, each carrying its gRPC status code (DESIGN §7).

Plain modules raise these; the gRPC layer turns them into a status with the same message.
"""

from __future__ import annotations

import grpc


class ShimError(Exception):
    """An error with the gRPC code the caller must see. The message says what failed and what to do."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(ShimError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ShimError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(ShimError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Aborted(ShimError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ShimError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(ShimError):
    code = grpc.StatusCode.DATA_LOSS


class Internal(ShimError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(ShimError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ShimError):
    code = grpc.StatusCode.UNIMPLEMENTED
