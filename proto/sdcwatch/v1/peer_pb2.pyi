from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutBlobRequest(_message.Message):
    __slots__ = ("key", "total_bytes", "data", "finish")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    key: str
    total_bytes: int
    data: bytes
    finish: bool
    def __init__(self, key: _Optional[str] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., finish: _Optional[bool] = ...) -> None: ...

class PutBlobResponse(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class GetBlobRequest(_message.Message):
    __slots__ = ("key", "offset", "length", "to_end", "chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TO_END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    to_end: bool
    chunk_bytes: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., to_end: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("offset", "data", "blob_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    blob_bytes: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., blob_bytes: _Optional[int] = ...) -> None: ...

class StatBlobRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class StatBlobResponse(_message.Message):
    __slots__ = ("exists", "size")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    size: int
    def __init__(self, exists: _Optional[bool] = ..., size: _Optional[int] = ...) -> None: ...

class ListBlobsRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class ListBlobsResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteBlobRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteBlobResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ChecksumBlobRequest(_message.Message):
    __slots__ = ("key", "ranges")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    key: str
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    def __init__(self, key: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ...) -> None: ...

class ChecksumBlobResponse(_message.Message):
    __slots__ = ("size", "checksums")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    size: int
    checksums: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, size: _Optional[int] = ..., checksums: _Optional[_Iterable[str]] = ...) -> None: ...
