"""One declared schema per file format the planner reads, and the one check of a parsed document against it.

The schemas are JSON Schema documents (draft 7) in ``planner/core/schemas/``: ``graph`` (docs/graph-format.md),
``device`` (a DeviceSpec file), ``plan`` (a plan file, docs/search.md), ``results`` (one search's results.json),
``bundle`` (candidates exported for the GPU machine) and ``measured`` (results timed there, docs/gpu.md). They fix the fields and their types; what a
schema cannot say (shapes that fit an op, a graph's order, a plan that computes its graph, a content hash) the
loaders check after. ``fastjsonschema`` compiles each schema once; a document that breaks one is refused with the
path of the offending value (``nodes[3].shape[1] must be integer``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fastjsonschema

SCHEMA_DIR = Path(__file__).with_name("schemas")
#: the formats that have a schema, by the file's stem
FORMATS = tuple(sorted(p.stem for p in SCHEMA_DIR.glob("*.json")))
#: characters of a schema's message kept (a hostile file's value or key may be any length)
MESSAGE_CHARS = 300


@functools.cache
def schema(kind: str) -> dict[str, Any]:
    """The declared schema of format ``kind``."""
    if kind not in FORMATS:
        raise KeyError(f"no schema for {kind!r}; the formats are {', '.join(FORMATS)}")
    return dict(json.loads((SCHEMA_DIR / f"{kind}.json").read_text()))


@functools.cache
def _validator(kind: str, part: str | None) -> Callable[[Any], Any]:
    declared = schema(kind)
    if part is not None:  # one of its definitions (a bundle's candidate, read on its own)
        if part not in declared.get("definitions", {}):
            raise KeyError(f"the {kind} schema defines no {part!r}")
        declared = {"definitions": declared["definitions"], "$ref": f"#/definitions/{part}"}
    return fastjsonschema.compile(declared)


def check_document(doc: Any, kind: str, source: str, error: type[Exception], part: str | None = None) -> None:
    """Raise ``error("<source>: <path> <what is wrong>")`` unless ``doc`` fits the schema of ``kind`` (or its
    definition ``part``)."""
    try:
        _validator(kind, part)(doc)
    except fastjsonschema.JsonSchemaValueException as exc:
        raise error(f"{source}: {_where(exc.message)}") from None


def _where(message: str) -> str:
    """fastjsonschema's message with the document's root (``data``) named as a reader would."""
    if message.startswith("data."):
        message = message[len("data."):]
    elif message.startswith("data["):
        message = message[len("data"):]
    elif message.startswith("data "):
        message = "the document " + message[len("data "):]
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "..."
