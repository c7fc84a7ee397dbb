"""One declared schema per file format: what the planner writes fits it, the schema agrees with the code's own
tables, and a document that breaks it is refused with the path of the offending value."""

from __future__ import annotations

import json
from dataclasses import fields

import fastjsonschema
import pytest

from planner.core import examples
from planner.core.cost import DeviceSpec, DeviceSpecError, KernelCost, device_from_json, load_device
from planner.core.dtypes import DTYPES
from planner.core.graph import GraphError, graph_from_json
from planner.core.planfile import plan_document
from planner.core.plans import KERNEL_KINDS
from planner.core.schema import FORMATS, check_document, schema
from planner.egraph.candidates import build_candidates


def test_every_format_has_a_schema_that_compiles():
    assert set(FORMATS) == {"graph", "device", "plan", "results", "bundle", "measured"}
    for kind in FORMATS:
        fastjsonschema.compile(schema(kind))  # every $ref resolves
        with pytest.raises(ValueError, match="^f: "):
            check_document([], kind, "f", ValueError)
    with pytest.raises(KeyError, match="no schema for 'notes'"):
        schema("notes")


def test_the_schemas_agree_with_the_code():
    device = schema("device")
    assert set(device["properties"]) == {f.name for f in fields(DeviceSpec)}
    assert set(device["properties"]["matmul_tflops"]["allOf"][1]["required"]) == set(DTYPES)
    kernel = schema("plan")["definitions"]["kernel"]
    assert kernel["properties"]["kind"]["enum"] == [str(k) for k in KERNEL_KINDS]
    assert set(kernel["properties"]["cost"]["required"]) == {f.name for f in fields(KernelCost)}


def test_what_the_planner_writes_fits_its_schema():
    graph = examples.mlp_epilogue(16, 32, 24, "fp16", "tanh")
    spec = load_device("h200")
    check_document(graph.to_json(), "graph", "graph", ValueError)
    check_document(spec.to_json(), "device", "device", ValueError)
    cands = build_candidates(graph, spec)
    for plan in cands.plans:
        check_document(json.loads(json.dumps(plan_document(plan, graph, spec))), "plan", "plan", ValueError)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["nodes"][2].update(shape=[64, "32"]), "g.json: nodes[2].shape[1] must be integer"),
    (lambda d: d["nodes"][2].update(shape=[64, True]), "g.json: nodes[2].shape[1] must be integer"),
    (lambda d: d["nodes"][4].update(inputs="mm"), "g.json: nodes[4].inputs must be array"),
    (lambda d: d["nodes"][4].update(input=["mm"]), "g.json: nodes[4] must not contain {'input'} properties"),
    (lambda d: d.update(outputs=[]), "g.json: outputs must contain at least 1 items"),
    (lambda d: d.update(version=2), "g.json: version must be same as const definition: 1"),
])
def test_a_graph_that_breaks_its_schema_names_the_path(edit, needle):
    doc = examples.mlp_epilogue(16, 32, 24, "fp16", "tanh").to_json()
    edit(doc)
    with pytest.raises(GraphError) as info:
        graph_from_json(doc, "g.json")
    assert str(info.value) == needle


def test_a_device_file_that_breaks_its_schema_names_the_path():
    doc = load_device("h200").to_json()
    doc["matmul_tflops"].pop("bf16")
    with pytest.raises(DeviceSpecError, match=r"device file d.json: matmul_tflops must contain \['bf16'\] properties"):
        device_from_json(doc, "d.json")
    doc = load_device("h200").to_json() | {"bandwidth_gbps": 0}
    with pytest.raises(DeviceSpecError, match="device file d.json: bandwidth_gbps must be bigger than 0"):
        device_from_json(doc, "d.json")


def test_a_huge_value_in_a_message_is_cut():
    doc = examples.ew_chain(2, 64).to_json()
    doc["nodes"][0]["x" * 10_000] = 1
    with pytest.raises(GraphError) as info:
        graph_from_json(doc, "g.json")
    assert len(str(info.value)) < 400 and str(info.value).endswith("...")
