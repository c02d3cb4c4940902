"""RequestGuard: unparsable requests are INVALID_ARGUMENT for all four method kinds, even when the
handler turns unexpected errors into INTERNAL (as the service's error wrappers do)."""

from concurrent import futures

import grpc
import pytest

from actcache._proto import actcache_pb2 as pb
from actcache.daemon.service._guard import RequestGuard

SERVICE = "test.Guarded"
GOOD = pb.ScheduleChunk(schedule_id="ok").SerializeToString()
BAD = b"\xff\xff\xff"
_identity = lambda x: x  # noqa: E731


def _careless(handler):
    """Like the service's wrappers: anything unexpected becomes INTERNAL."""
    def run(request, context):
        try:
            return handler(request, context)
        except Exception as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"failed: {exc!r}")
    return run


def _careless_stream(handler):
    def run(request, context):
        try:
            yield from handler(request, context)
        except Exception as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"failed: {exc!r}")
    return run


@pytest.fixture(scope="module")
def channel(tmp_path_factory):
    parse = pb.ScheduleChunk.FromString
    handlers = {
        "UU": grpc.unary_unary_rpc_method_handler(_careless(lambda r, c: r.schedule_id), parse, str.encode),
        "US": grpc.unary_stream_rpc_method_handler(_careless_stream(lambda r, c: iter([r.schedule_id])), parse, str.encode),
        "SU": grpc.stream_unary_rpc_method_handler(_careless(lambda it, c: ",".join(m.schedule_id for m in it)), parse,
                                                   str.encode),
        "SS": grpc.stream_stream_rpc_method_handler(_careless_stream(lambda it, c: (m.schedule_id for m in it)), parse,
                                                    str.encode),
    }
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
                         interceptors=[RequestGuard(SERVICE)])
    address = f"unix:{tmp_path_factory.mktemp('guard')}/s.sock"
    server.add_insecure_port(address)
    server.start()
    with grpc.insecure_channel(address) as ch:
        yield ch
    server.stop(None)


@pytest.mark.parametrize("kind", ["UU", "US", "SU", "SS"])
def test_good_requests_pass_and_bad_ones_are_invalid_argument(channel, kind):
    path = f"/{SERVICE}/{kind}"
    stub = getattr(channel, {"UU": "unary_unary", "US": "unary_stream", "SU": "stream_unary", "SS": "stream_stream"}[kind])(
        path, request_serializer=_identity, response_deserializer=_identity)

    def send(messages):
        request = iter(messages) if kind[0] == "S" else messages[0]
        result = stub(request, timeout=10)
        return b"".join(result) if kind[1] == "S" else result

    assert send([GOOD, GOOD] if kind[0] == "S" else [GOOD]).startswith(b"ok")
    with pytest.raises(grpc.RpcError) as info:
        send([GOOD, BAD] if kind[0] == "S" else [BAD])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in info.value.details()
