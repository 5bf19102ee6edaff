"""Exported KV as one self-describing blob: ExportKV's chunks, each length-delimited.

``kv_bytes`` writes the blob as protobuf's writeDelimitedTo writes a stream (a varint
length, then the message); ``kv_chunks`` reads it back, whole and checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from mtpdraft.v1 import drafter_pb2 as pb


def kv_bytes(chunks: Iterable[pb.KVChunk]) -> bytes:
    """Exported KV as one self-describing blob: each chunk length-delimited (a varint
    length, then the message), as protobuf's writeDelimitedTo writes a stream."""
    out = bytearray()
    for chunk in chunks:
        data = chunk.SerializeToString()
        out += _varint(len(data))
        out += data
    return bytes(out)


def kv_chunks(kv: bytes | Iterable[pb.KVChunk]) -> Iterator[pb.KVChunk]:
    """The chunks of exported KV, given as the blob of ``kv_bytes`` (checked whole now:
    ValueError for one cut inside a chunk) or as ExportKV's chunks (passed on as they come)."""
    if not isinstance(kv, bytes | bytearray | memoryview):
        return iter(kv)
    data, chunks, at = bytes(kv), [], 0
    while at < len(data):
        size, at = _read_varint(data, at)
        if at + size > len(data):
            raise ValueError(f"exported KV: cut short ({len(data) - at} of a chunk's {size} bytes)")
        chunks.append(pb.KVChunk.FromString(data[at : at + size]))
        at += size
    return iter(chunks)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("exported KV: cut short or corrupt (a chunk's length)")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at
