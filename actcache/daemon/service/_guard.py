"""Requests that do not parse are INVALID_ARGUMENT, for every method of the service.

gRPC Python answers a request its deserializer rejects with INTERNAL before
the handler runs. RequestGuard, a server interceptor, makes each ActCache
method's deserializer return an ``Unparsable`` marker instead: an unparsable
unary request is answered INVALID_ARGUMENT without calling the handler; in a
request stream the handler sees the messages that parsed, then InvalidRequest,
and the status is INVALID_ARGUMENT whatever the handler answers after that.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

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


class _Messages:
    """Iterates a request stream, raising InvalidRequest at the first unparsable message; as a context
    manager, turns any error after that into INVALID_ARGUMENT, whatever the handler made of it."""

    def __init__(self, inner: Iterator[Any], context) -> None:
        self._inner, self._context = inner, context
        self.error: str | None = None

    def __iter__(self) -> "_Messages":
        return self

    def __next__(self) -> Any:
        message = next(self._inner)
        if isinstance(message, Unparsable):
            self.error = message.message
            raise InvalidRequest(message.message)
        return message

    def __enter__(self) -> "_Messages":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, Exception) and self.error is not None:
            self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.error)


def _guard(behavior: Callable, handler: grpc.RpcMethodHandler) -> Callable:
    if not handler.request_streaming:

        def unary_request(request, context):  # a response stream is returned: gRPC handles an abort here alike
            if isinstance(request, Unparsable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return behavior(request, context)

        return unary_request

    def stream_stream(requests, context):
        with _Messages(requests, context) as messages:
            yield from behavior(messages, context)

    def stream_unary(requests, context):
        with _Messages(requests, context) as messages:
            return behavior(messages, context)

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
