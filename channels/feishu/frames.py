"""The long connection's wire format: Feishu's `pbbp2.Frame`, a protobuf (proto2) message,
encoded and decoded by hand (nine fields; no protobuf runtime needed).

    message Header { required string key = 1; required string value = 2; }
    message Frame {
      required uint64 SeqID = 1;   required uint64 LogID = 2;
      required int32 service = 3;  required int32 method = 4;   // 0 control, 1 data
      repeated Header headers = 5;
      optional string payload_encoding = 6;  optional string payload_type = 7;
      optional bytes payload = 8;            optional string LogIDNew = 9;
    }

The schema is the one Feishu's SDKs carry (lark-oapi's `ws/pb/pbbp2.proto`). A control
frame's `type` header is `ping` or `pong`; a data frame's is `event` (or `card`), with
`message_id`, `sum` and `seq` (a payload split over `sum` frames) and `trace_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

CONTROL = 0
DATA = 1

_VARINT = 0
_LENGTH = 2


class FrameError(ValueError):
    """Bytes that are no `pbbp2.Frame`."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of the long connection."""

    seq_id: int = 0
    log_id: int = 0
    service: int = 0
    method: int = CONTROL
    headers: tuple[tuple[str, str], ...] = ()
    payload_encoding: str = ""
    payload_type: str = ""
    payload: bytes = b""
    log_id_new: str = ""
    _present: frozenset[int] = field(default=frozenset(), compare=False, repr=False)

    def header(self, key: str, default: str = "") -> str:
        for name, value in self.headers:
            if name == key:
                return value
        return default

    def with_header(self, key: str, value: str) -> Frame:
        return replace(self, headers=(*self.headers, (key, value)))

    def encode(self) -> bytes:
        out = bytearray()
        _put_varint_field(out, 1, self.seq_id)
        _put_varint_field(out, 2, self.log_id)
        _put_varint_field(out, 3, self.service & 0xFFFFFFFFFFFFFFFF)
        _put_varint_field(out, 4, self.method & 0xFFFFFFFFFFFFFFFF)
        for key, value in self.headers:
            inner = bytearray()
            _put_bytes_field(inner, 1, key.encode())
            _put_bytes_field(inner, 2, value.encode())
            _put_bytes_field(out, 5, bytes(inner))
        if self.payload_encoding:
            _put_bytes_field(out, 6, self.payload_encoding.encode())
        if self.payload_type:
            _put_bytes_field(out, 7, self.payload_type.encode())
        if self.payload or 8 in self._present:
            _put_bytes_field(out, 8, self.payload)
        if self.log_id_new:
            _put_bytes_field(out, 9, self.log_id_new.encode())
        return bytes(out)

    @classmethod
    def decode(cls, data: bytes) -> Frame:
        values: dict[int, object] = {}
        headers: list[tuple[str, str]] = []
        for number, wire, value in _fields(data):
            if number == 5:
                if wire != _LENGTH or not isinstance(value, bytes):
                    raise FrameError("a header that is no message")
                parts = {n: v for n, w, v in _fields(value) if w == _LENGTH}
                key, val = parts.get(1, b""), parts.get(2, b"")
                assert isinstance(key, bytes) and isinstance(val, bytes)
                headers.append((key.decode("utf-8", "replace"), val.decode("utf-8", "replace")))
            else:
                values[number] = value
        for required in (1, 2, 3, 4):
            if required not in values:
                raise FrameError(f"field {required} is missing")

        def integer(n: int, signed: bool = False) -> int:
            raw = values[n]
            if not isinstance(raw, int):
                raise FrameError(f"field {n} is no number")
            if signed and raw >= 1 << 63:
                raw -= 1 << 64
            return raw

        def text(n: int) -> str:
            raw = values.get(n, b"")
            if not isinstance(raw, bytes):
                raise FrameError(f"field {n} is no string")
            return raw.decode("utf-8", "replace")

        payload = values.get(8, b"")
        if not isinstance(payload, bytes):
            raise FrameError("the payload is no bytes")
        return cls(
            seq_id=integer(1),
            log_id=integer(2),
            service=integer(3, signed=True),
            method=integer(4, signed=True),
            headers=tuple(headers),
            payload_encoding=text(6),
            payload_type=text(7),
            payload=payload,
            log_id_new=text(9),
            _present=frozenset(values),
        )


def _put_varint(out: bytearray, value: int) -> None:
    if value < 0:
        raise FrameError("a negative varint")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _put_varint_field(out: bytearray, number: int, value: int) -> None:
    _put_varint(out, number << 3 | _VARINT)
    _put_varint(out, value)


def _put_bytes_field(out: bytearray, number: int, value: bytes) -> None:
    _put_varint(out, number << 3 | _LENGTH)
    _put_varint(out, len(value))
    out.extend(value)


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(data):
            raise FrameError("a varint runs past the end")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise FrameError("a varint longer than 10 bytes")


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of every field; unknown varint, length, 32- and
    64-bit fields are read past."""
    found: list[tuple[int, int, int | bytes]] = []
    position = 0
    while position < len(data):
        key, position = _read_varint(data, position)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise FrameError("field number 0")
        if wire == _VARINT:
            value, position = _read_varint(data, position)
            found.append((number, wire, value))
        elif wire == _LENGTH:
            length, position = _read_varint(data, position)
            end = position + length
            if end > len(data):
                raise FrameError("a field runs past the end")
            found.append((number, wire, bytes(data[position:end])))
            position = end
        elif wire == 1:
            position += 8
        elif wire == 5:
            position += 4
        else:
            raise FrameError(f"wire type {wire}")
        if position > len(data):
            raise FrameError("a field runs past the end")
    return found
