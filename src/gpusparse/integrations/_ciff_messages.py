"""CIFF's protobuf messages, built at run time from their definition (no protoc, no generated file).

The Common Index File Format (https://github.com/osirrc/ciff, ``CommonIndexFileFormat.proto``,
package ``io.osirrc.ciff``, proto3) is one ``Header``, then ``num_postings_lists``
``PostingsList`` messages, then ``num_doc_records`` ``DocRecord`` messages, each written with
a varint length prefix (Java's ``writeDelimitedTo``). Inside a postings list, ``docid`` is
the gap to the previous posting's document (the first is absolute).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from ._require import require

PACKAGE = "io.osirrc.ciff"

# (message, [(field, number, type, repeated message type or None)]) as in the .proto.
_FIELDS: dict[str, list[tuple[str, int, str, str | None]]] = {
    "Header": [
        ("version", 1, "int32", None),
        ("num_postings_lists", 2, "int32", None),
        ("num_doc_records", 3, "int32", None),
        ("total_postings_lists", 4, "int32", None),
        ("total_docs", 5, "int32", None),
        ("total_terms_in_collection", 6, "int64", None),
        ("average_doclength", 7, "double", None),
        ("description", 8, "string", None),
    ],
    "Posting": [("docid", 1, "int32", None), ("tf", 2, "int32", None)],
    "PostingsList": [
        ("term", 1, "string", None),
        ("df", 2, "int64", None),
        ("cf", 3, "int64", None),
        ("postings", 4, "message", "Posting"),
    ],
    "DocRecord": [
        ("docid", 1, "int32", None),
        ("collection_docid", 2, "string", None),
        ("doclength", 3, "int32", None),
    ],
}


@cache
def messages() -> dict[str, Any]:
    """``{"Header": class, "Posting": ..., "PostingsList": ..., "DocRecord": ...}`` (needs protobuf)."""
    require("google.protobuf", "ciff", "CIFF")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="gpusparse_ciff.proto", package=PACKAGE, syntax="proto3")
    types = descriptor_pb2.FieldDescriptorProto
    for name, fields in _FIELDS.items():
        msg = proto.message_type.add(name=name)
        for field, number, kind, ref in fields:
            f = msg.field.add(name=field, number=number, json_name=field)
            if kind == "message":
                f.type = types.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{ref}"
                f.label = types.LABEL_REPEATED
            else:
                f.type = getattr(types, f"TYPE_{kind.upper()}")
                f.label = types.LABEL_OPTIONAL
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in _FIELDS}
