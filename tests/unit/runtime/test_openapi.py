"""``/openapi.json`` says what the routes really answer: the statuses, the content types and the bodies."""

from __future__ import annotations

from typing import Any

import pytest

from omnimodel_runtime.serve import build_serve_app, serve_pipeline
from omnimodel_runtime.settings import RuntimeSettings

PRESETS = ["text", "tts", "text-to-image", "qwen2.5-omni", "qwen3-omni", "qwen-image-edit"]


def _doc(preset: str) -> dict[str, Any]:
    app = build_serve_app(RuntimeSettings(), serve_pipeline(preset, f"tiny://{preset}", device="cpu"))
    doc: dict[str, Any] = app.openapi()
    return doc


@pytest.mark.parametrize("preset", PRESETS)
def test_no_operation_documents_a_422_or_an_empty_success(preset: str) -> None:
    doc = _doc(preset)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            for media, content in responses["200"]["content"].items():
                assert content["schema"], (method, path, media)


@pytest.mark.parametrize("preset", PRESETS)
def test_api_errors_are_documented_with_the_openai_envelope(preset: str) -> None:
    doc = _doc(preset)
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            responses = operation["responses"]
            wanted = {"401", "500"} | ({"400", "404", "413", "503"} if method == "post" else set())
            assert wanted <= set(responses), (method, path, sorted(responses))
            for status in wanted:
                assert responses[status]["content"]["application/json"]["schema"] == envelope


def test_content_types_are_the_ones_sent() -> None:
    doc = _doc("qwen2.5-omni")
    paths = doc["paths"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    speech = set(paths["/v1/audio/speech"]["post"]["responses"]["200"]["content"])
    assert speech == {"audio/wav", "audio/pcm", "audio/flac", "audio/mpeg", "audio/ogg; codecs=opus"}
    chat = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}
    assert chat["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionResponse"}
    formats = doc["components"]["schemas"]["SpeechRequest"]["properties"]["response_format"]
    assert "aac" not in str(formats)
