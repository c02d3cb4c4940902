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
    """Iterates a request stream, raising InvalidRequest at the first unparsable message."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner = inner
        self.error: str | None = None

    def __iter__(self) -> "_Messages":
        return self

    def __next__(self) -> Any:
        message = next(self._inner)
        if isinstance(message, Unparsable):
            self.error = message.message
            raise InvalidRequest(message.message)
        return message


def _guard_unary_request(behavior: Callable, streaming_response: bool) -> Callable:
    def guarded(request, context):  # a response stream is returned: gRPC handles an abort here alike
        if isinstance(request, Unparsable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, context)

    return guarded


def _guard_stream_request(behavior: Callable, streaming_response: bool) -> Callable:
    if streaming_response:

        def stream(requests, context):
            messages = _Messages(requests)
            try:
                yield from behavior(messages, context)
            except Exception:
                if messages.error is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, messages.error)
                raise

        return stream

    def unary(requests, context):
        messages = _Messages(requests)
        try:
            return behavior(messages, context)
        except Exception:
            if messages.error is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, messages.error)
            raise

    return unary


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
        guard = _guard_stream_request if handler.request_streaming else _guard_unary_request
        method = details.method[len(self._prefix) :]
        return rewrap(handler, lambda behavior: guard(behavior, handler.response_streaming),
                      _lenient(handler.request_deserializer, method))
