from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frame(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    payload: bytes
    def __init__(self, header: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("name", "create", "secret", "job", "client_version", "protocol_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    create: bool
    secret: bytes
    job: JobInfo
    client_version: str
    protocol_version: int
    def __init__(self, name: _Optional[str] = ..., create: _Optional[bool] = ..., secret: _Optional[bytes] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ..., client_version: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("pid", "host", "start_time", "data_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    DATA_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    host: str
    start_time: float
    data_id: str
    def __init__(self, pid: _Optional[int] = ..., host: _Optional[str] = ..., start_time: _Optional[float] = ..., data_id: _Optional[str] = ...) -> None: ...

class OpenReply(_message.Message):
    __slots__ = ("namespace_id", "namespace_budget_bytes", "daemon_budget_bytes", "max_message_bytes", "max_entry_bytes", "server_version", "protocol_version")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    namespace_budget_bytes: int
    daemon_budget_bytes: int
    max_message_bytes: int
    max_entry_bytes: int
    server_version: str
    protocol_version: int
    def __init__(self, namespace_id: _Optional[int] = ..., namespace_budget_bytes: _Optional[int] = ..., daemon_budget_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_entry_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace_id", "fingerprint", "depth", "sample_ids", "variants", "lengths", "encoding", "segment_bytes", "segment_offset", "layout", "packed_sample_ids", "packed_variants")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PACKED_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    fingerprint: bytes
    depth: int
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    variants: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    encoding: str
    segment_bytes: int
    segment_offset: int
    layout: bytes
    packed_sample_ids: bytes
    packed_variants: bytes
    def __init__(self, namespace_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., depth: _Optional[int] = ..., sample_ids: _Optional[_Iterable[int]] = ..., variants: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., encoding: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., segment_offset: _Optional[int] = ..., layout: _Optional[bytes] = ..., packed_sample_ids: _Optional[bytes] = ..., packed_variants: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("entries", "stored_bytes", "replaced", "segment")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    entries: int
    stored_bytes: int
    replaced: int
    segment: str
    def __init__(self, entries: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., replaced: _Optional[int] = ..., segment: _Optional[str] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "fingerprint", "depth", "sample_ids", "variants")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    fingerprint: bytes
    depth: int
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    variants: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., depth: _Optional[int] = ..., sample_ids: _Optional[_Iterable[int]] = ..., variants: _Optional[_Iterable[int]] = ...) -> None: ...

class EntriesHeader(_message.Message):
    __slots__ = ("start", "sample_ids", "variants", "lengths", "data_plane", "data_plane_detail", "segment", "offsets", "columns")
    START_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    start: int
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    variants: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    data_plane: str
    data_plane_detail: str
    segment: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    columns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[int] = ..., sample_ids: _Optional[_Iterable[int]] = ..., variants: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., data_plane: _Optional[str] = ..., data_plane_detail: _Optional[str] = ..., segment: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., columns: _Optional[_Iterable[int]] = ...) -> None: ...

class ScheduleChunk(_message.Message):
    __slots__ = ("namespace_id", "fingerprint", "depth", "schedule_id", "sample_ids", "variants", "packed_sample_ids", "packed_variants", "report_present")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_PRESENT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    fingerprint: bytes
    depth: int
    schedule_id: str
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    variants: _containers.RepeatedScalarFieldContainer[int]
    packed_sample_ids: bytes
    packed_variants: bytes
    report_present: bool
    def __init__(self, namespace_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., depth: _Optional[int] = ..., schedule_id: _Optional[str] = ..., sample_ids: _Optional[_Iterable[int]] = ..., variants: _Optional[_Iterable[int]] = ..., packed_sample_ids: _Optional[bytes] = ..., packed_variants: _Optional[bytes] = ..., report_present: _Optional[bool] = ...) -> None: ...

class ScheduleReply(_message.Message):
    __slots__ = ("schedule_id", "length", "replaced", "present")
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    schedule_id: str
    length: int
    replaced: bool
    present: bytes
    def __init__(self, schedule_id: _Optional[str] = ..., length: _Optional[int] = ..., replaced: _Optional[bool] = ..., present: _Optional[bytes] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("namespace_id", "schedule_id", "start", "max_frame_bytes", "shared_memory", "ring_bytes", "reuse_segment", "whole_frames", "columns")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    schedule_id: str
    start: int
    max_frame_bytes: int
    shared_memory: bool
    ring_bytes: int
    reuse_segment: str
    whole_frames: bool
    columns: bool
    def __init__(self, namespace_id: _Optional[int] = ..., schedule_id: _Optional[str] = ..., start: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., ring_bytes: _Optional[int] = ..., reuse_segment: _Optional[str] = ..., whole_frames: _Optional[bool] = ..., columns: _Optional[bool] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("namespace_id", "fingerprint", "depth", "packed_sample_ids", "packed_variants")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    PACKED_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    fingerprint: bytes
    depth: int
    packed_sample_ids: bytes
    packed_variants: bytes
    def __init__(self, namespace_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., depth: _Optional[int] = ..., packed_sample_ids: _Optional[bytes] = ..., packed_variants: _Optional[bytes] = ...) -> None: ...

class ContainsReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: bytes
    def __init__(self, present: _Optional[bytes] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("namespace_id", "fingerprint", "depth")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    fingerprint: bytes
    depth: int
    def __init__(self, namespace_id: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., depth: _Optional[int] = ...) -> None: ...

class DropReply(_message.Message):
    __slots__ = ("entries", "bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupStats(_message.Message):
    __slots__ = ("namespace", "fingerprint", "depth", "entries", "bytes", "last_write_time", "last_read_time", "reclaimable", "live_schedules")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_WRITE_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_READ_TIME_FIELD_NUMBER: _ClassVar[int]
    RECLAIMABLE_FIELD_NUMBER: _ClassVar[int]
    LIVE_SCHEDULES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    fingerprint: bytes
    depth: int
    entries: int
    bytes: int
    last_write_time: float
    last_read_time: float
    reclaimable: bool
    live_schedules: int
    def __init__(self, namespace: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., depth: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., last_write_time: _Optional[float] = ..., last_read_time: _Optional[float] = ..., reclaimable: _Optional[bool] = ..., live_schedules: _Optional[int] = ...) -> None: ...

class JobStats(_message.Message):
    __slots__ = ("job", "first_seen", "last_seen", "opens", "ended", "local")
    JOB_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    OPENS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    job: JobInfo
    first_seen: float
    last_seen: float
    opens: int
    ended: float
    local: bool
    def __init__(self, job: _Optional[_Union[JobInfo, _Mapping]] = ..., first_seen: _Optional[float] = ..., last_seen: _Optional[float] = ..., opens: _Optional[int] = ..., ended: _Optional[float] = ..., local: _Optional[bool] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("name", "namespace_id", "entries", "bytes", "budget_bytes", "reclaimable_bytes", "jobs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace_id: int
    entries: int
    bytes: int
    budget_bytes: int
    reclaimable_bytes: int
    jobs: _containers.RepeatedCompositeFieldContainer[JobStats]
    def __init__(self, name: _Optional[str] = ..., namespace_id: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., reclaimable_bytes: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[JobStats, _Mapping]]] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("namespaces", "groups", "used_bytes", "budget_bytes", "map_size_bytes", "file_bytes", "puts_total", "put_bytes_total", "gets_total", "hits_total", "misses_total", "served_bytes_total", "corrupt_total", "uptime_seconds", "server_version", "schedules", "prefetch", "prefetch_budget_bytes", "prefetch_buffered_bytes", "prefetch_max_buffered_bytes", "schedules_total", "fetches_total", "explicit_reads_total", "fallback_reads_total", "reclaimable_bytes", "reclaimed_generations_total", "reclaimed_bytes_total", "reclaim_after_seconds", "now", "cached_copies_total", "rings_created_total", "rings_reused_total", "page_layout_unrecognized_total", "put_segments_total")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUT_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GETS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_MAX_BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FETCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_READS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_READS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECLAIMABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_GENERATIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    CACHED_COPIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RINGS_CREATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RINGS_REUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGE_LAYOUT_UNRECOGNIZED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUT_SEGMENTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStats]
    used_bytes: int
    budget_bytes: int
    map_size_bytes: int
    file_bytes: int
    puts_total: int
    put_bytes_total: int
    gets_total: int
    hits_total: int
    misses_total: int
    served_bytes_total: int
    corrupt_total: int
    uptime_seconds: float
    server_version: str
    schedules: _containers.RepeatedCompositeFieldContainer[ScheduleStats]
    prefetch: _containers.RepeatedCompositeFieldContainer[NamespacePrefetchStats]
    prefetch_budget_bytes: int
    prefetch_buffered_bytes: int
    prefetch_max_buffered_bytes: int
    schedules_total: int
    fetches_total: int
    explicit_reads_total: int
    fallback_reads_total: int
    reclaimable_bytes: int
    reclaimed_generations_total: int
    reclaimed_bytes_total: int
    reclaim_after_seconds: float
    now: float
    cached_copies_total: int
    rings_created_total: int
    rings_reused_total: int
    page_layout_unrecognized_total: int
    put_segments_total: int
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupStats, _Mapping]]] = ..., used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., map_size_bytes: _Optional[int] = ..., file_bytes: _Optional[int] = ..., puts_total: _Optional[int] = ..., put_bytes_total: _Optional[int] = ..., gets_total: _Optional[int] = ..., hits_total: _Optional[int] = ..., misses_total: _Optional[int] = ..., served_bytes_total: _Optional[int] = ..., corrupt_total: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., server_version: _Optional[str] = ..., schedules: _Optional[_Iterable[_Union[ScheduleStats, _Mapping]]] = ..., prefetch: _Optional[_Iterable[_Union[NamespacePrefetchStats, _Mapping]]] = ..., prefetch_budget_bytes: _Optional[int] = ..., prefetch_buffered_bytes: _Optional[int] = ..., prefetch_max_buffered_bytes: _Optional[int] = ..., schedules_total: _Optional[int] = ..., fetches_total: _Optional[int] = ..., explicit_reads_total: _Optional[int] = ..., fallback_reads_total: _Optional[int] = ..., reclaimable_bytes: _Optional[int] = ..., reclaimed_generations_total: _Optional[int] = ..., reclaimed_bytes_total: _Optional[int] = ..., reclaim_after_seconds: _Optional[float] = ..., now: _Optional[float] = ..., cached_copies_total: _Optional[int] = ..., rings_created_total: _Optional[int] = ..., rings_reused_total: _Optional[int] = ..., page_layout_unrecognized_total: _Optional[int] = ..., put_segments_total: _Optional[int] = ...) -> None: ...

class PrefetchCounters(_message.Message):
    __slots__ = ("hits", "misses", "hit_ratio", "corrupt", "ready_on_ask", "stalls", "stall_seconds", "read_bytes", "served_bytes", "direct")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    READY_ON_ASK_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    hit_ratio: float
    corrupt: int
    ready_on_ask: int
    stalls: int
    stall_seconds: float
    read_bytes: int
    served_bytes: int
    direct: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., corrupt: _Optional[int] = ..., ready_on_ask: _Optional[int] = ..., stalls: _Optional[int] = ..., stall_seconds: _Optional[float] = ..., read_bytes: _Optional[int] = ..., served_bytes: _Optional[int] = ..., direct: _Optional[int] = ...) -> None: ...

class ScheduleStats(_message.Message):
    __slots__ = ("namespace", "schedule_id", "state", "length", "start", "served", "ready", "read", "read_ahead_entries", "buffered_bytes", "attached", "counters")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    schedule_id: str
    state: str
    length: int
    start: int
    served: int
    ready: int
    read: int
    read_ahead_entries: int
    buffered_bytes: int
    attached: bool
    counters: PrefetchCounters
    def __init__(self, namespace: _Optional[str] = ..., schedule_id: _Optional[str] = ..., state: _Optional[str] = ..., length: _Optional[int] = ..., start: _Optional[int] = ..., served: _Optional[int] = ..., ready: _Optional[int] = ..., read: _Optional[int] = ..., read_ahead_entries: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., attached: _Optional[bool] = ..., counters: _Optional[_Union[PrefetchCounters, _Mapping]] = ...) -> None: ...

class NamespacePrefetchStats(_message.Message):
    __slots__ = ("namespace", "schedules", "read_ahead_entries", "buffered_bytes", "counters")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULES_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    schedules: int
    read_ahead_entries: int
    buffered_bytes: int
    counters: PrefetchCounters
    def __init__(self, namespace: _Optional[str] = ..., schedules: _Optional[int] = ..., read_ahead_entries: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., counters: _Optional[_Union[PrefetchCounters, _Mapping]] = ...) -> None: ...
