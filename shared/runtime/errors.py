"""Domain errors raised by core classes; each gRPC edge maps them to a status (DESIGN.md §8)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc


class ServingError(Exception):
    """An error with the gRPC status it must reach the client with."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, pushback_ms: int | None = None, nothing_ran: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.pushback_ms = pushback_ms
        self.nothing_ran = nothing_ran   # refused on arrival: another deployment may take the request


NOTHING_RAN = "academus-nothing-ran"   # trailer of a refusal on arrival whose code does not say so itself
PUSHBACK = "grpc-retry-pushback-ms"    # trailer: how long the caller should wait before its next request
# trailer of every status a handler of ours chose: its process is alive (an UNAVAILABLE without it came from
# the transport or a stopping server: the peer is gone)
ANSWERED = "academus-answered"


def answered(error: grpc.aio.AioRpcError) -> bool:
    """The status was a live handler's choice (ANSWERED), not a transport failure or a stopping server."""
    return dict(error.trailing_metadata() or ()).get(ANSWERED) == "true"


def pushback_ms(trailers: Iterable[tuple[str, str]]) -> int | None:
    """The retry pushback hint (ms) among a status's trailers; None when it has none."""
    value = dict(trailers).get(PUSHBACK)
    return int(value) if value else None


class InvalidArgument(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(ServingError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServingError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServingError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServingError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServingError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServingError):
    code = grpc.StatusCode.UNAVAILABLE


class Unreachable(Unavailable):
    """UNAVAILABLE that no live handler chose: the peer refused the connection, or went away mid-call (a
    restart), where a live peer's own UNAVAILABLE ("no live worker serves ...") is its considered answer."""


async def abort_with(context: grpc.aio.ServicerContext, error: ServingError) -> None:
    """Aborts the RPC with the error's status, adding the retry pushback hint when it has one."""
    trailers = [(ANSWERED, "true")]
    if error.pushback_ms is not None:
        trailers.append((PUSHBACK, str(error.pushback_ms)))
    if error.nothing_ran:
        trailers.append((NOTHING_RAN, "true"))
    context.set_trailing_metadata(tuple(trailers))
    await context.abort(error.code, error.message)


def from_rpc_error(error: grpc.aio.AioRpcError, hop: str) -> ServingError:
    """Re-raises a downstream status unchanged in code, with the hop named for the operator; UNAVAILABLE
    that no handler answered is Unreachable."""
    trailers = dict(error.trailing_metadata() or ())
    details = error.details() or f"{hop} failed with {error.code().name}"
    if error.code() == grpc.StatusCode.UNAVAILABLE and trailers.get(ANSWERED) != "true":
        return Unreachable(details, nothing_ran=trailers.get(NOTHING_RAN) == "true")
    return from_status(error.code(), details, pushback_ms(trailers.items()), trailers.get(NOTHING_RAN) == "true")


def from_status(code: grpc.StatusCode, message: str, pushback_ms: int | None = None,
                nothing_ran: bool = False) -> ServingError:
    """The ServingError of a status code (one carried in a message rather than on the call)."""
    cls = next((c for c in _ALL if c.code == code), ServingError)
    err = cls(message, pushback_ms=pushback_ms, nothing_ran=nothing_ran)
    if cls is ServingError:
        err.code = code
    return err


_ALL = (InvalidArgument, Unauthenticated, PermissionDenied, NotFound, AlreadyExists, FailedPrecondition,
        ResourceExhausted, DeadlineExceeded, Unavailable)
