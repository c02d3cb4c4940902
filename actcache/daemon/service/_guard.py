"""Requests that do not parse are INVALID_ARGUMENT (gRPC Python would answer INTERNAL), for every method.

RequestGuard makes each ActCache method's deserializer return an ``Unparsable`` marker: an unparsable
unary request is refused before the handler runs; a request stream raises InvalidRequest at it, and
the call ends INVALID_ARGUMENT whatever the handler answers after that.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import grpc

from actcache.errors import InvalidRequest

__all__ = ["RequestGuard", "Unparsable", "rewrap"]


class Unparsable:
    """Stands for a request message that failed to parse."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Unparsable(f"{method} request of {len(data)} bytes does not parse: {exc or type(exc).__name__}")

    return parse


def _parsed(requests: Iterable[Any], errors: list[str]) -> Iterator[Any]:
    """The request stream up to its first unparsable message, whose error is added to ``errors`` and raised."""
    for message in requests:
        if isinstance(message, Unparsable):
            errors.append(message.message)
            raise InvalidRequest(message.message)
        yield message


@contextmanager
def _invalid_after(context) -> Iterator[list[str]]:
    """Yields a list for ``_parsed``'s errors: any error once it holds one ends the call INVALID_ARGUMENT,
    whatever the handler made of it."""
    errors: list[str] = []
    try:
        yield errors
    except Exception:
        if errors:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, errors[0])
        raise


def _guard(behavior: Callable, handler: grpc.RpcMethodHandler) -> Callable:
    if not handler.request_streaming:

        def unary_request(request, context):  # a response stream is returned: gRPC handles an abort here alike
            if isinstance(request, Unparsable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return behavior(request, context)

        return unary_request

    def stream_stream(requests, context):
        with _invalid_after(context) as errors:
            yield from behavior(_parsed(requests, errors), context)

    def stream_unary(requests, context):
        with _invalid_after(context) as errors:
            return behavior(_parsed(requests, errors), context)

    return stream_stream if handler.response_streaming else stream_unary


def rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable],
           request_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind whose behaviour is ``wrap(its behaviour)`` (for interceptors)."""
    kind = f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(wrap(getattr(handler, kind)), request_deserializer or handler.request_deserializer,
                   handler.response_serializer)


class RequestGuard(grpc.ServerInterceptor):
    """Makes unparsable requests to ``service``'s methods INVALID_ARGUMENT (see module doc)."""

    def __init__(self, service: str) -> None:
        self._prefix = f"/{service}/"

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        method = details.method[len(self._prefix) :]
        return rewrap(handler, lambda behavior: _guard(behavior, handler),
                      _lenient(handler.request_deserializer, method))
