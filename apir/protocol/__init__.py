"""The wire protocol: messages, opcodes, encoding and validation. No I/O here."""

from .messages import (
    ALIGN,
    ARENA_ALIGN,
    INLINE_MAX,
    MAGIC,
    MAX_BODY,
    PROTOCOL_VERSION,
    WANT_REPLY,
    ErrorCode,
    FrameHeader,
    decode_body,
    decode_header,
    encode,
    op_table_hash,
)
from .wire import ProtocolError

__all__ = [
    "ALIGN", "ARENA_ALIGN", "INLINE_MAX", "MAGIC", "MAX_BODY", "PROTOCOL_VERSION", "WANT_REPLY", "ErrorCode", "FrameHeader",
    "ProtocolError", "decode_body", "decode_header", "encode", "op_table_hash",
]
