from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHandshake(_message.Message):
    __slots__ = ("role", "model_name", "model_fingerprint", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "max_model_len", "host_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_name: str
    model_fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    host_id: str
    def __init__(self, role: _Optional[str] = ..., model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_model_len: _Optional[int] = ..., host_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "cache_salt", "first_block", "shm_path", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    first_block: int
    shm_path: str
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., first_block: _Optional[int] = ..., shm_path: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("chunk", "done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: KVChunk
    done: PrefillDone
    def __init__(self, chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("offset", "data", "crc32", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    crc32: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "export_s", "prefill_s")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPORT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    export_s: float
    prefill_s: float
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., export_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...
