from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.body_parse import parse_request_body
from gateway.errors import BadRequest
from gateway.media_parts import Modality, Source, find_media


def find(route: str, document: dict[str, Any]) -> list[tuple[Modality, Source, str]]:
    return [(r.modality, r.source, r.locator) for r in find_media(route, parse_request_body(orjson.dumps(document)))]


def test_chat_parts_in_every_role() -> None:
    document = {
        "messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "user", "content": "plain text"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg", "detail": "low"}},
                    {"type": "image_url", "image_url": "https://example.com/b.jpg"},
                    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                ],
            },
            {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}}]},
        ]
    }
    assert find("/v1/chat/completions", document) == [
        (Modality.IMAGE, Source.DATA_URL, "messages[0].content[0].image_url"),
        (Modality.IMAGE, Source.URL, "messages[2].content[1].image_url"),
        (Modality.IMAGE, Source.URL, "messages[2].content[2].image_url"),
        (Modality.VIDEO, Source.URL, "messages[2].content[3].video_url"),
        (Modality.AUDIO, Source.BASE64, "messages[2].content[4].input_audio"),
        (Modality.IMAGE, Source.DATA_URL, "messages[3].content[0].image_url"),
    ]


def test_text_only_requests_have_no_media() -> None:
    assert find("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) == []
    assert find("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}) == []
    assert find("/v1/responses", {"input": "hi"}) == []


def test_anthropic_images_including_tool_results() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    document = {
        "system": "be brief",
        "messages": [
            {
                "role": "user",
                "content": [image, {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "a"}, image]}
                ],
            },
        ],
    }
    refs = find_media("/v1/messages", parse_request_body(orjson.dumps(document)))
    assert [(r.source, r.locator, r.media_type) for r in refs] == [
        (Source.BASE64, "messages[0].content[0].source", "image/png"),
        (Source.URL, "messages[0].content[1].source", None),
        (Source.BASE64, "messages[1].content[0].content[1].source", "image/png"),
    ]


def test_anthropic_file_source_is_refused() -> None:
    document = {
        "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]
    }
    with pytest.raises(BadRequest, match=r"messages\[0\]\.content\[0\]\.source\.type 'file' is not supported"):
        find("/v1/messages", document)


def test_responses_input_images() -> None:
    document = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "x"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
                ],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_image", "image_url": "https://e.com/i.png"}],
            },
        ]
    }
    assert find("/v1/responses", document) == [
        (Modality.IMAGE, Source.DATA_URL, "input[0].content[1].image_url"),
        (Modality.IMAGE, Source.URL, "input[1].content[0].image_url"),
    ]


def test_responses_file_id_is_refused() -> None:
    document = {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}]}
    with pytest.raises(BadRequest, match=r"input\[0\]\.content\[0\]\.file_id is not supported"):
        find("/v1/responses", document)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"messages": [{"content": [{"type": "image_url", "image_url": {"url": 5}}]}]}, "must hold a url string"),
        ({"messages": [{"content": [{"type": "image_url"}]}]}, "must hold a url string"),
        ({"messages": [{"content": [{"type": "input_audio", "input_audio": {}}]}]}, "must be a base64 string"),
    ],
)
def test_malformed_parts_are_400_naming_the_item(document: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message) as raised:
        find("/v1/chat/completions", document)
    assert "messages[0].content[0]" in raised.value.message


def test_non_object_body_is_400() -> None:
    with pytest.raises(BadRequest, match="must be a JSON object"):
        find("/v1/chat/completions", [1, 2])  # type: ignore[arg-type]


def test_refs_carry_the_path_to_their_part() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    messages = {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": [image]}]}]}
    chat = {"messages": [{"role": "user", "content": [{"type": "text"}, {"type": "image_url", "image_url": "x"}]}]}
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://e/i"}]}]}
    for route, document, path in [
        ("/v1/messages", messages, ("messages", 0, "content", 0, "content", 0)),
        ("/v1/chat/completions", chat, ("messages", 0, "content", 1)),
        ("/v1/responses", responses, ("input", 0, "content", 0)),
    ]:
        (ref,) = find_media(route, parse_request_body(orjson.dumps(document)))
        node: Any = document
        for key in path:
            node = node[key]
        assert ref.path == path
        assert node["type"] in ("image", "image_url", "input_image")
