"""A protobuf message as a frozen dataclass of plain Python values, field for field.

``record_type`` makes the dataclass from the message's descriptor, ``record_values`` reads
a message into its fields: a field the message type gains is a field of the record, with no
edit here. Values: strings, ints, floats and bools as they are; a DType by its name
("bfloat16"), another enum by its value's name; a repeated field as a tuple, a map as a
dict, a message as a dict of its fields. Every field has its type's default, as on the wire.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from mtpdraft.v1 import drafter_pb2 as pb

from . import wire

_F = FieldDescriptor
_SCALARS: dict[int, type] = {
    _F.CPPTYPE_INT32: int,
    _F.CPPTYPE_INT64: int,
    _F.CPPTYPE_UINT32: int,
    _F.CPPTYPE_UINT64: int,
    _F.CPPTYPE_DOUBLE: float,
    _F.CPPTYPE_FLOAT: float,
    _F.CPPTYPE_BOOL: bool,
    _F.CPPTYPE_STRING: str,
    _F.CPPTYPE_ENUM: str,  # by name
    _F.CPPTYPE_MESSAGE: dict,
}


def _is_map(field: FieldDescriptor) -> bool:
    entry = field.message_type
    return entry is not None and entry.GetOptions().map_entry


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf 6.32 on; label is deprecated
    return field.label == _F.LABEL_REPEATED if repeated is None else bool(repeated)


def _field_type(field: FieldDescriptor) -> Any:
    if _is_map(field):
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        return dict[_field_type(key), _field_type(value)]  # type: ignore[misc]
    one = _SCALARS[field.cpp_type]
    return tuple[one, ...] if _is_repeated(field) else one


def _default(field: FieldDescriptor) -> Any:
    if _is_map(field):
        return dataclasses.field(default_factory=dict)
    if _is_repeated(field):
        return ()
    if field.cpp_type == _F.CPPTYPE_MESSAGE:
        return dataclasses.field(default_factory=dict)
    if field.cpp_type == _F.CPPTYPE_ENUM:
        return _enum_name(field, field.default_value)
    return field.default_value


def record_type(descriptor: Descriptor) -> type:
    """A frozen, slotted dataclass named after the message, with a field for each of its
    fields, in their order (a subclass with ``__slots__ = ()`` names and documents it)."""
    fields = [(f.name, _field_type(f), _default(f)) for f in descriptor.fields]
    record = dataclasses.make_dataclass(descriptor.name, fields, frozen=True, slots=True)
    record.__module__ = __name__
    return record


def _enum_name(field: FieldDescriptor, number: int) -> str:
    if field.enum_type is pb.DType.DESCRIPTOR:
        return wire.dtype_name(number)
    value = field.enum_type.values_by_number.get(number)
    return value.name if value is not None else str(number)


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.cpp_type == _F.CPPTYPE_ENUM:
        return _enum_name(field, value)
    if field.cpp_type == _F.CPPTYPE_MESSAGE:
        return record_values(value)
    return value


def record_values(message: Any) -> dict[str, Any]:
    """The message's fields by name, as ``record_type``'s record holds them."""
    values = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if _is_map(field):
            key, item = (field.message_type.fields_by_name[n] for n in ("key", "value"))
            values[field.name] = {_value(key, k): _value(item, v) for k, v in value.items()}
        elif _is_repeated(field):
            values[field.name] = tuple(_value(field, v) for v in value)
        else:
            values[field.name] = _value(field, value)
    return values
