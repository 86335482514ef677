"""The ONNX export: valid by the ONNX checker, with docs/model.md's inputs and 38 named tap outputs."""

from __future__ import annotations

import onnx

from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MAX_SPEAKERS, MEL_BINS, TAP_NAMES
from speakerd.onnx.export import build_onnx


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


def test_checker_passes_and_every_tap_is_an_output(folded_model) -> None:
    model = build_onnx(folded_model, taps=True)
    onnx.checker.check_model(model, full_check=True)  # raises with the offending node
    assert [o.name for o in model.graph.output] == list(TAP_NAMES)
    inputs = {i.name: _dims(i) for i in model.graph.input}
    assert inputs == {"fbank": ["n", FRAMES, MEL_BINS], "masks": ["n", MAX_SPEAKERS, "F"]}, inputs
    assert _dims(model.graph.output[-1]) == ["rows", EMBEDDING_DIM]
    assert folded_model.model_id in model.doc_string


def test_serving_graph_has_only_the_output(folded_model) -> None:
    model = build_onnx(folded_model, taps=False)
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["output"]
