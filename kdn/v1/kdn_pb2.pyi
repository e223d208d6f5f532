from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Durability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DURABILITY_DEFAULT: _ClassVar[Durability]
    DURABILITY_MEMORY: _ClassVar[Durability]
    DURABILITY_DISK: _ClassVar[Durability]
    DURABILITY_SHARED: _ClassVar[Durability]
DURABILITY_DEFAULT: Durability
DURABILITY_MEMORY: Durability
DURABILITY_DISK: Durability
DURABILITY_SHARED: Durability

class RopeSpec(_message.Message):
    __slots__ = ("theta", "rotary_dim", "scaling", "keys_rotated")
    THETA_FIELD_NUMBER: _ClassVar[int]
    ROTARY_DIM_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    KEYS_ROTATED_FIELD_NUMBER: _ClassVar[int]
    theta: float
    rotary_dim: int
    scaling: str
    keys_rotated: bool
    def __init__(self, theta: _Optional[float] = ..., rotary_dim: _Optional[int] = ..., scaling: _Optional[str] = ..., keys_rotated: _Optional[bool] = ...) -> None: ...

class LayerLayout(_message.Message):
    __slots__ = ("kv_heads", "k_channels", "v_channels", "k_kept", "v_kept", "has_k_kept", "has_v_kept")
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    K_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    V_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    K_KEPT_FIELD_NUMBER: _ClassVar[int]
    V_KEPT_FIELD_NUMBER: _ClassVar[int]
    HAS_K_KEPT_FIELD_NUMBER: _ClassVar[int]
    HAS_V_KEPT_FIELD_NUMBER: _ClassVar[int]
    kv_heads: int
    k_channels: int
    v_channels: int
    k_kept: _containers.RepeatedScalarFieldContainer[int]
    v_kept: _containers.RepeatedScalarFieldContainer[int]
    has_k_kept: bool
    has_v_kept: bool
    def __init__(self, kv_heads: _Optional[int] = ..., k_channels: _Optional[int] = ..., v_channels: _Optional[int] = ..., k_kept: _Optional[_Iterable[int]] = ..., v_kept: _Optional[_Iterable[int]] = ..., has_k_kept: _Optional[bool] = ..., has_v_kept: _Optional[bool] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("model_fingerprint", "model_name", "dtype", "head_dim", "rope", "layers")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    model_name: str
    dtype: str
    head_dim: int
    rope: RopeSpec
    layers: _containers.RepeatedCompositeFieldContainer[LayerLayout]
    def __init__(self, model_fingerprint: _Optional[str] = ..., model_name: _Optional[str] = ..., dtype: _Optional[str] = ..., head_dim: _Optional[int] = ..., rope: _Optional[_Union[RopeSpec, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerLayout, _Mapping]]] = ...) -> None: ...

class Codec(_message.Message):
    __slots__ = ("mode", "level", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    level: str
    params: _containers.ScalarMap[str, str]
    def __init__(self, mode: _Optional[str] = ..., level: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ...) -> None: ...

class FrameSpan(_message.Message):
    __slots__ = ("first_layer", "num_layers", "checksum")
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    first_layer: int
    num_layers: int
    checksum: int
    def __init__(self, first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class EntryHeader(_message.Message):
    __slots__ = ("layout", "codec", "tokens", "start_position", "frames", "layout_fingerprint")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    codec: Codec
    tokens: int
    start_position: int
    frames: _containers.RepeatedCompositeFieldContainer[FrameSpan]
    layout_fingerprint: str
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., codec: _Optional[_Union[Codec, _Mapping]] = ..., tokens: _Optional[int] = ..., start_position: _Optional[int] = ..., frames: _Optional[_Iterable[_Union[FrameSpan, _Mapping]]] = ..., layout_fingerprint: _Optional[str] = ...) -> None: ...

class StoreOptions(_message.Message):
    __slots__ = ("ttl_seconds", "pin", "durability")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    pin: bool
    durability: Durability
    def __init__(self, ttl_seconds: _Optional[int] = ..., pin: _Optional[bool] = ..., durability: _Optional[_Union[Durability, str]] = ...) -> None: ...

class StoreHeader(_message.Message):
    __slots__ = ("namespace", "key", "container_header", "layout_fingerprint", "total_bytes", "options")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    container_header: bytes
    layout_fingerprint: str
    total_bytes: int
    options: StoreOptions
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., container_header: _Optional[bytes] = ..., layout_fingerprint: _Optional[str] = ..., total_bytes: _Optional[int] = ..., options: _Optional[_Union[StoreOptions, _Mapping]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("index", "data", "offset")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    offset: int
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class StoreHeaders(_message.Message):
    __slots__ = ("headers",)
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[StoreHeader]
    def __init__(self, headers: _Optional[_Iterable[_Union[StoreHeader, _Mapping]]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "frame", "headers")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    frame: Frame
    headers: StoreHeaders
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., frame: _Optional[_Union[Frame, _Mapping]] = ..., headers: _Optional[_Union[StoreHeaders, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored_bytes", "tier", "replaced")
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    stored_bytes: int
    tier: str
    replaced: bool
    def __init__(self, stored_bytes: _Optional[int] = ..., tier: _Optional[str] = ..., replaced: _Optional[bool] = ...) -> None: ...

class StoreManyResponse(_message.Message):
    __slots__ = ("results", "reads_grouped")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    READS_GROUPED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StoreResponse]
    reads_grouped: bool
    def __init__(self, results: _Optional[_Iterable[_Union[StoreResponse, _Mapping]]] = ..., reads_grouped: _Optional[bool] = ...) -> None: ...

class RetrieveRequest(_message.Message):
    __slots__ = ("namespace", "key", "expect_layout_fingerprint", "first_layer", "last_layer", "piece_bytes", "piece_min_entry_bytes", "expect_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECE_MIN_ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    expect_layout_fingerprint: str
    first_layer: int
    last_layer: int
    piece_bytes: int
    piece_min_entry_bytes: int
    expect_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., expect_layout_fingerprint: _Optional[str] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., piece_bytes: _Optional[int] = ..., piece_min_entry_bytes: _Optional[int] = ..., expect_tokens: _Optional[int] = ...) -> None: ...

class RetrieveHeader(_message.Message):
    __slots__ = ("container_header", "total_bytes", "tier", "frame_count", "entry_digest", "missing", "entry")
    CONTAINER_HEADER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FRAME_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    container_header: bytes
    total_bytes: int
    tier: str
    frame_count: int
    entry_digest: int
    missing: bool
    entry: bytes
    def __init__(self, container_header: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., tier: _Optional[str] = ..., frame_count: _Optional[int] = ..., entry_digest: _Optional[int] = ..., missing: _Optional[bool] = ..., entry: _Optional[bytes] = ...) -> None: ...

class RetrieveHeaders(_message.Message):
    __slots__ = ("headers",)
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[RetrieveHeader]
    def __init__(self, headers: _Optional[_Iterable[_Union[RetrieveHeader, _Mapping]]] = ...) -> None: ...

class RetrieveManyRequest(_message.Message):
    __slots__ = ("namespace", "keys", "expect_layout_fingerprint", "grouped", "inline_max_entry_bytes", "inline_budget_bytes", "expect_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GROUPED_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    expect_layout_fingerprint: str
    grouped: bool
    inline_max_entry_bytes: int
    inline_budget_bytes: int
    expect_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., expect_layout_fingerprint: _Optional[str] = ..., grouped: _Optional[bool] = ..., inline_max_entry_bytes: _Optional[int] = ..., inline_budget_bytes: _Optional[int] = ..., expect_tokens: _Optional[int] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("header", "frame", "headers")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    header: RetrieveHeader
    frame: Frame
    headers: RetrieveHeaders
    def __init__(self, header: _Optional[_Union[RetrieveHeader, _Mapping]] = ..., frame: _Optional[_Union[Frame, _Mapping]] = ..., headers: _Optional[_Union[RetrieveHeaders, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "prefix_chain")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CHAIN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_chain: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., prefix_chain: _Optional[bool] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("present", "tier", "size_bytes")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    present: bool
    tier: str
    size_bytes: int
    def __init__(self, present: _Optional[bool] = ..., tier: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("infos", "prefix_hits")
    INFOS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    infos: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    prefix_hits: int
    def __init__(self, infos: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ..., prefix_hits: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tenant: str
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "entries", "bytes", "capacity_bytes", "hits", "misses", "evictions", "corrupt", "healthy", "degraded", "parts_down")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    PARTS_DOWN_FIELD_NUMBER: _ClassVar[int]
    name: str
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt: int
    healthy: bool
    degraded: bool
    parts_down: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ..., healthy: _Optional[bool] = ..., degraded: _Optional[bool] = ..., parts_down: _Optional[_Iterable[str]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "entries", "bytes", "quota_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    entries: int
    bytes: int
    quota_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "version", "tenants", "health", "features")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    version: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    health: str
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., version: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., health: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("pid", "fd", "size", "nonce", "remote")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    size: int
    nonce: bytes
    remote: bool
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ..., remote: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("segment_id", "fast_path", "data_port", "seals")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    fast_path: str
    data_port: int
    seals: bool
    def __init__(self, segment_id: _Optional[str] = ..., fast_path: _Optional[str] = ..., data_port: _Optional[int] = ..., seals: _Optional[bool] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("segment_id",)
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    def __init__(self, segment_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Region(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class GetManyRequest(_message.Message):
    __slots__ = ("namespace", "keys", "segment_id", "region", "expect_layout_fingerprint", "lease", "release", "inline_max_entry_bytes", "inline_below_bytes", "read_listed", "expect_tokens", "call")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_BELOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_LISTED_FIELD_NUMBER: _ClassVar[int]
    EXPECT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    segment_id: str
    region: Region
    expect_layout_fingerprint: str
    lease: bool
    release: _containers.RepeatedScalarFieldContainer[int]
    inline_max_entry_bytes: int
    inline_below_bytes: int
    read_listed: _containers.RepeatedScalarFieldContainer[int]
    expect_tokens: int
    call: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., segment_id: _Optional[str] = ..., region: _Optional[_Union[Region, _Mapping]] = ..., expect_layout_fingerprint: _Optional[str] = ..., lease: _Optional[bool] = ..., release: _Optional[_Iterable[int]] = ..., inline_max_entry_bytes: _Optional[int] = ..., inline_below_bytes: _Optional[int] = ..., read_listed: _Optional[_Iterable[int]] = ..., expect_tokens: _Optional[int] = ..., call: _Optional[int] = ...) -> None: ...

class EntryRef(_message.Message):
    __slots__ = ("present", "tier", "length", "written", "offset", "data", "verified", "lease", "generation", "generation_at")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_AT_FIELD_NUMBER: _ClassVar[int]
    present: bool
    tier: str
    length: int
    written: bool
    offset: int
    data: bytes
    verified: bool
    lease: int
    generation: int
    generation_at: int
    def __init__(self, present: _Optional[bool] = ..., tier: _Optional[str] = ..., length: _Optional[int] = ..., written: _Optional[bool] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., verified: _Optional[bool] = ..., lease: _Optional[int] = ..., generation: _Optional[int] = ..., generation_at: _Optional[int] = ...) -> None: ...

class GetManyResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[EntryRef]
    def __init__(self, entries: _Optional[_Iterable[_Union[EntryRef, _Mapping]]] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("key", "region", "data", "options", "seal")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    region: Region
    data: bytes
    options: StoreOptions
    seal: bool
    def __init__(self, key: _Optional[bytes] = ..., region: _Optional[_Union[Region, _Mapping]] = ..., data: _Optional[bytes] = ..., options: _Optional[_Union[StoreOptions, _Mapping]] = ..., seal: _Optional[bool] = ...) -> None: ...

class PutManyRequest(_message.Message):
    __slots__ = ("namespace", "segment_id", "items")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    segment_id: str
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    def __init__(self, namespace: _Optional[str] = ..., segment_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ...) -> None: ...

class PutManyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StoreResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[StoreResponse, _Mapping]]] = ...) -> None: ...

class EntryInfo(_message.Message):
    __slots__ = ("namespace", "key", "tenant", "model_fingerprint", "model_name", "layout_fingerprint", "num_layers", "dtype", "codec_mode", "codec_level", "tokens", "size_bytes", "tiers", "pinned", "age_seconds", "layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_MODE_FIELD_NUMBER: _ClassVar[int]
    CODEC_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    tenant: str
    model_fingerprint: str
    model_name: str
    layout_fingerprint: str
    num_layers: int
    dtype: str
    codec_mode: str
    codec_level: str
    tokens: int
    size_bytes: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    pinned: bool
    age_seconds: float
    layout: Layout
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., tenant: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., model_name: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., codec_mode: _Optional[str] = ..., codec_level: _Optional[str] = ..., tokens: _Optional[int] = ..., size_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., pinned: _Optional[bool] = ..., age_seconds: _Optional[float] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("namespace", "key_prefix", "model_fingerprint", "limit", "page_token", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key_prefix: bytes
    model_fingerprint: str
    limit: int
    page_token: bytes
    tenant: str
    def __init__(self, namespace: _Optional[str] = ..., key_prefix: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[EntryInfo]
    next_page_token: bytes
    def __init__(self, entries: _Optional[_Iterable[_Union[EntryInfo, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("namespace", "key", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    tenant: str
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("namespace", "keys", "tier", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    tenant: str
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class VerifyProgress(_message.Message):
    __slots__ = ("tier", "scanned", "total", "corrupt", "removed", "corrupt_keys", "done")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SCANNED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    tier: str
    scanned: int
    total: int
    corrupt: int
    removed: int
    corrupt_keys: _containers.RepeatedScalarFieldContainer[str]
    done: bool
    def __init__(self, tier: _Optional[str] = ..., scanned: _Optional[int] = ..., total: _Optional[int] = ..., corrupt: _Optional[int] = ..., removed: _Optional[int] = ..., corrupt_keys: _Optional[_Iterable[str]] = ..., done: _Optional[bool] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("namespace", "key_prefix", "after", "tenant", "piece_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key_prefix: bytes
    after: bytes
    tenant: str
    piece_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., key_prefix: _Optional[bytes] = ..., after: _Optional[bytes] = ..., tenant: _Optional[str] = ..., piece_bytes: _Optional[int] = ...) -> None: ...

class ExportItem(_message.Message):
    __slots__ = ("namespace", "key", "value", "cursor", "total", "tenant", "offset", "more", "ttl_seconds", "pinned")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    value: bytes
    cursor: bytes
    total: int
    tenant: str
    offset: int
    more: bool
    ttl_seconds: float
    pinned: bool
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., cursor: _Optional[bytes] = ..., total: _Optional[int] = ..., tenant: _Optional[str] = ..., offset: _Optional[int] = ..., more: _Optional[bool] = ..., ttl_seconds: _Optional[float] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ImportItem(_message.Message):
    __slots__ = ("namespace", "key", "value", "tenant", "offset", "more", "ttl_seconds", "pin")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    value: bytes
    tenant: str
    offset: int
    more: bool
    ttl_seconds: float
    pin: bool
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., tenant: _Optional[str] = ..., offset: _Optional[int] = ..., more: _Optional[bool] = ..., ttl_seconds: _Optional[float] = ..., pin: _Optional[bool] = ...) -> None: ...

class ImportResponse(_message.Message):
    __slots__ = ("imported", "skipped", "rejected", "reasons")
    IMPORTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    imported: int
    skipped: int
    rejected: int
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, imported: _Optional[int] = ..., skipped: _Optional[int] = ..., rejected: _Optional[int] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class GcRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GcResponse(_message.Message):
    __slots__ = ("removed", "freed_bytes", "usage_recounted")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USAGE_RECOUNTED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    freed_bytes: int
    usage_recounted: bool
    def __init__(self, removed: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., usage_recounted: _Optional[bool] = ...) -> None: ...

class BlendPiece(_message.Message):
    __slots__ = ("chunk_key", "token_ids", "text")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    chunk_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, chunk_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class BlendRequest(_message.Message):
    __slots__ = ("namespace", "pieces", "ratio", "select_layer", "head_tokens", "per_chunk", "store", "mode", "level", "expect_layout_fingerprint", "query_share")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    SELECT_LAYER_FIELD_NUMBER: _ClassVar[int]
    HEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUERY_SHARE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pieces: _containers.RepeatedCompositeFieldContainer[BlendPiece]
    ratio: float
    select_layer: int
    head_tokens: int
    per_chunk: bool
    store: bool
    mode: str
    level: str
    expect_layout_fingerprint: str
    query_share: float
    def __init__(self, namespace: _Optional[str] = ..., pieces: _Optional[_Iterable[_Union[BlendPiece, _Mapping]]] = ..., ratio: _Optional[float] = ..., select_layer: _Optional[int] = ..., head_tokens: _Optional[int] = ..., per_chunk: _Optional[bool] = ..., store: _Optional[bool] = ..., mode: _Optional[str] = ..., level: _Optional[str] = ..., expect_layout_fingerprint: _Optional[str] = ..., query_share: _Optional[float] = ...) -> None: ...
