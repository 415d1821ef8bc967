"""Finding media items in each route's shapes.

The shapes beyond the OpenAI and Anthropic references are what the upstream servers' own parsers load, read from:

- vLLM main at 001eadcf: vllm/entrypoints/chat_utils.py (`MM_PARSER_MAP`, `_parse_chat_message_content_mm_part`,
  `_parse_chat_message_content_part`, `_parse_chat_message_content`), vllm/entrypoints/openai/responses/utils.py
  (`_construct_message_from_response_item`) and vllm/entrypoints/anthropic/serving.py
  (`_convert_image_source_to_url`, `_convert_user_tool_result`);
- TensorRT-LLM main at 0c351902: tensorrt_llm/serve/chat_utils.py (`MM_PARSER_MAP`,
  `_parse_chat_message_content_mm_part`, `parse_chat_message_content_part`), tensorrt_llm/serve/responses_utils.py
  (`_response_output_item_to_chat_completion_message`) and tensorrt_llm/serve/anthropic_adapter.py (`_image_part`).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.media.body import LONG_STRING_BYTES, SKELETON_MIN_BODY_BYTES, ParsedBody, parse_request_body
from gateway.media.parts import Modality, Source, find_media


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


def chat(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": ["plain text part", *parts]}]}


def refs(route: str, document: dict[str, Any]) -> list[tuple[Modality, Source, str, Any]]:
    found = find_media(route, parse_request_body(orjson.dumps(document)))
    return [(r.modality, r.source, r.locator, r.value if isinstance(r.value, str) else bytes(r.value)) for r in found]


def test_audio_url_parts_are_found() -> None:
    """`audio_url` ({"url"} object; bare string without `type`): vLLM `MM_PARSER_MAP["audio_url"]` and the
    typeless branch of `_parse_chat_message_content_mm_part`; trtllm `MM_PARSER_MAP["audio_url"]`."""
    document = chat(
        {"type": "audio_url", "audio_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}},
        {"audio_url": "https://e.com/a.mp3"},
    )
    assert refs("/v1/chat/completions", document) == [
        (Modality.AUDIO, Source.URL, "messages[0].content[1].audio_url", "http://169.254.169.254/latest/meta-data/"),
        (Modality.AUDIO, Source.DATA_URL, "messages[0].content[2].audio_url", "data:audio/wav;base64,UklGRg=="),
        (Modality.AUDIO, Source.URL, "messages[0].content[3].audio_url", "https://e.com/a.mp3"),
    ]


def test_parts_without_type_are_read_by_their_one_media_field() -> None:
    """vLLM `_parse_chat_message_content_mm_part`: with `type` missing, the field present (`image_url`,
    `audio_url`, a non-null `input_audio`, `video_url`) names what is loaded, as a string or a {"url"} object."""
    document = chat(
        {"image_url": "http://169.254.169.254/"},
        {"image_url": {"url": "data:image/png;base64,AA=="}},
        {"video_url": {"url": "https://e.com/v.mp4"}},
        {"input_audio": {"data": "UklGRg==", "format": "mp3"}},
        {"text": "a part with no type and no media field is not media"},
    )
    assert refs("/v1/chat/completions", document) == [
        (Modality.IMAGE, Source.URL, "messages[0].content[1].image_url", "http://169.254.169.254/"),
        (Modality.IMAGE, Source.DATA_URL, "messages[0].content[2].image_url", "data:image/png;base64,AA=="),
        (Modality.VIDEO, Source.URL, "messages[0].content[3].video_url", "https://e.com/v.mp4"),
        (Modality.AUDIO, Source.BASE64, "messages[0].content[4].input_audio", "UklGRg=="),
    ]


def test_a_uuid_makes_the_media_field_win_over_the_type() -> None:
    """vLLM `_parse_chat_message_content_mm_part` takes the typed branch only when `uuid` is None; with a
    `uuid`, even a `text` part loads the media field it holds. Without one, a stray field on a text part is
    ignored by both upstreams."""
    document = chat(
        {"type": "text", "text": "x", "uuid": "u1", "image_url": {"url": "http://169.254.169.254/"}},
        {"type": "text", "text": "no uuid", "image_url": {"url": "http://169.254.169.254/"}},
        {"type": "refusal", "refusal": "no", "video_url": "https://e.com/v.mp4"},
    )
    assert refs("/v1/chat/completions", document) == [
        (Modality.IMAGE, Source.URL, "messages[0].content[1].image_url", "http://169.254.169.254/"),
    ]


def test_a_uuid_with_no_media_is_a_cache_reference_and_not_an_item() -> None:
    """vLLM `parse_image` / `parse_audio` / `parse_video` fetch nothing for a null URL: with a `uuid` the
    upstream uses the item it cached under it. Without a `uuid` a missing URL is still a 400."""
    document = chat(
        {"type": "image_url", "image_url": None, "uuid": "img-1"},
        {"type": "audio_url", "audio_url": {"url": None}, "uuid": "aud-1"},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}, "uuid": "aud-2"},
        {"video_url": None, "uuid": "vid-1"},
    )
    assert refs("/v1/chat/completions", document) == []
    with pytest.raises(BadRequest, match=r"content\[1\]\.audio_url must hold a url string"):
        refs("/v1/chat/completions", chat({"type": "audio_url", "audio_url": {"url": None}}))


def test_input_image_parts_in_chat_are_found() -> None:
    """vLLM `MM_PARSER_MAP["input_image"]` reads the Responses image shape in chat messages too."""
    document = chat({"type": "input_image", "image_url": "http://169.254.169.254/", "detail": "auto"})
    assert refs("/v1/chat/completions", document) == [
        (Modality.IMAGE, Source.URL, "messages[0].content[1].image_url", "http://169.254.169.254/"),
    ]
    with pytest.raises(BadRequest, match=r"content\[1\]\.file_id is not supported"):
        refs("/v1/chat/completions", chat({"type": "input_image", "file_id": "file-1"}))


@pytest.mark.parametrize(
    ("part", "name"),
    [
        ({"type": "image_embeds", "image_embeds": "AAAA"}, "image_embeds"),
        ({"type": "image_embeds", "image_embeds": {"data": "AAAA"}}, "image_embeds"),  # trtllm's shape
        ({"image_embeds": {"image_embeds": "AAAA", "image_grid_thw": "BBBB"}}, "image_embeds"),
        ({"type": "audio_embeds", "audio_embeds": "AAAA"}, "audio_embeds"),
        ({"type": "prompt_embeds", "data": "AAAA"}, "prompt_embeds"),
        ({"prompt_embeds": None, "data": "AAAA"}, "prompt_embeds"),
        ({"type": "image_pil", "image_pil": "not an image"}, "image_pil"),
        ({"type": "text", "uuid": "u", "image_embeds": "AAAA"}, "image_embeds"),
    ],
)
def test_parts_the_gateway_cannot_count_are_refused_naming_why(part: dict[str, Any], name: str) -> None:
    """vLLM `parse_image_embeds` / `parse_audio_embeds` / `parse_prompt_embeds` (base64 torch tensors),
    `parse_image_pil`; trtllm `load_base64_image_embeds`. A tensor's memory is not known before it is loaded."""
    with pytest.raises(BadRequest, match=rf"messages\[0\]\.content\[1\]: {name} parts are not supported") as raised:
        refs("/v1/chat/completions", chat(part))
    assert raised.value.reason == "unsupported_media"
    assert ("tensor" in raised.value.message) != (name == "image_pil")


def test_a_part_with_two_media_fields_is_refused() -> None:
    """With a `uuid`, vLLM loads the first media field in its own order; trtllm loads the one the `type` names."""
    part = {"type": "video_url", "uuid": "u", "video_url": {"url": "https://e/v"}, "image_url": "http://10.0.0.1/"}
    with pytest.raises(BadRequest, match=r"content\[1\] holds more than one media field \(image_url, video_url\)"):
        refs("/v1/chat/completions", chat(part))


def test_responses_parts_are_read_with_the_chat_rules() -> None:
    """vLLM `_construct_message_from_response_item` hands input messages and function_call_output lists to the
    chat parser as they are; so does trtllm `_response_output_item_to_chat_completion_message` for messages
    without `type` and for function_call_output."""
    document = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "x"},
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                    {"type": "audio_url", "audio_url": {"url": "http://169.254.169.254/"}},
                ],
            },
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": "https://e.com/i.png"}, {"image_url": "https://e/j"}],
            },
        ]
    }
    assert refs("/v1/responses", document) == [
        (Modality.AUDIO, Source.BASE64, "input[0].content[1].input_audio", "UklGRg=="),
        (Modality.AUDIO, Source.URL, "input[0].content[2].audio_url", "http://169.254.169.254/"),
        (Modality.IMAGE, Source.URL, "input[1].output[0].image_url", "https://e.com/i.png"),
        (Modality.IMAGE, Source.URL, "input[1].output[1].image_url", "https://e/j"),
    ]


def test_anthropic_source_without_type_is_base64() -> None:
    """vLLM `_convert_image_source_to_url` reads any source that is not `url` as base64 data."""
    block = {"type": "image", "source": {"media_type": "image/png", "data": "AAAA"}}
    found = find_media("/v1/messages", parse_request_body(orjson.dumps({"messages": [{"content": [block]}]})))
    assert [(r.source, r.locator, r.value, r.media_type) for r in found] == [
        (Source.BASE64, "messages[0].content[0].source", "AAAA", "image/png")
    ]


def big_body(document: dict[str, Any]) -> bytes:
    """`document` with a text long enough that the body is parsed with placeholders for its long literals."""
    document["padding"] = "p" * SKELETON_MIN_BODY_BYTES
    raw = orjson.dumps(document)
    assert len(raw) >= SKELETON_MIN_BODY_BYTES
    return raw


def test_long_strings_in_a_big_body_are_resolved_everywhere() -> None:
    """In a body of 1 MiB or more, literals of 4 KiB or more parse as placeholders: every string a ref takes
    from the document (URLs of every shape, media types, audio formats) is the client's string."""
    url = "https://e.com/a.png?pad=" + "x" * LONG_STRING_BYTES
    long_type = "image/" + "y" * LONG_STRING_BYTES
    long_format = "z" * LONG_STRING_BYTES
    anthropic = {
        "messages": [
            {
                "content": [
                    {"type": "image", "source": {"type": "url", "url": url}},
                    {"type": "image", "source": {"type": "base64", "media_type": long_type, "data": "AAAA"}},
                ]
            }
        ]
    }
    found = find_media("/v1/messages", parse_request_body(big_body(anthropic)))
    assert [(r.source, r.value, r.media_type) for r in found] == [
        (Source.URL, url, None),
        (Source.BASE64, "AAAA", long_type),
    ]
    chat_document = chat(
        {"type": "audio_url", "audio_url": {"url": url}},
        {"image_url": url},
        {"type": "input_image", "image_url": url},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": long_format}},
    )
    found = find_media("/v1/chat/completions", parse_request_body(big_body(chat_document)))
    assert [r.value for r in found[:3]] == [url, url, url]
    assert found[3].media_type == f"audio/{long_format}"


def test_a_refusal_never_echoes_a_placeholder() -> None:
    kind = "k" * LONG_STRING_BYTES
    document = {"messages": [{"content": [{"type": "image", "source": {"type": kind, "data": "AAAA"}}]}]}
    with pytest.raises(BadRequest) as raised:
        find_media("/v1/messages", parse_request_body(big_body(document)))
    assert "\x00" not in raised.value.message
    assert f"source.type '{'k' * 40}...' is not supported" in raised.value.message


# --- the other routes whose bodies vLLM 0.32.0 reads media from (MEDIA_ROUTES; docs/admission.md) --------------

IMG = {"type": "image_url", "image_url": {"url": "https://e.com/i.png"}}


def located(route: str, document: dict[str, Any]) -> list[tuple[str, tuple[str | int, ...]]]:
    """Each item's locator and the keys from the root to the string that holds it."""
    return [(r.locator, r.value_path) for r in find_media(route, parse_request_body(orjson.dumps(document)))]


def test_a_batch_of_conversations_is_read_conversation_by_conversation() -> None:
    """vLLM `BatchChatCompletionRequest.messages` and `EmbeddingBatchChatRequest.messages`: a list of
    conversations; one level only (a list deeper than that is no message)."""
    document = {"messages": [[{"role": "user", "content": "text"}], [{"role": "user", "content": [IMG]}, [[IMG]]]]}
    assert located("/v1/chat/completions/batch", document) == [
        ("messages[1][0].content[0].image_url", ("messages", 1, 0, "content", 0, "image_url", "url"))
    ]


def test_pooling_routes_read_chat_messages_in_messages_and_in_input() -> None:
    """vLLM `EmbeddingChatInputRequest` / `EmbeddingBatchChatInputRequest` (`input` a conversation or a batch of
    them), `PoolingChatRequest` and `ClassificationChatRequest` (`messages`); text and token ids are not media."""
    conversation = [{"role": "user", "content": [{"type": "text", "text": "x"}, IMG]}]
    assert located("/v1/embeddings", {"input": conversation}) == [
        ("input[0].content[1].image_url", ("input", 0, "content", 1, "image_url", "url"))
    ]
    assert located("/v1/embeddings", {"input": [conversation, conversation]}) == [
        ("input[0][0].content[1].image_url", ("input", 0, 0, "content", 1, "image_url", "url")),
        ("input[1][0].content[1].image_url", ("input", 1, 0, "content", 1, "image_url", "url")),
    ]
    for route in ("/pooling", "/classify", "/v1/embeddings"):
        assert located(route, {"messages": conversation}) == [
            ("messages[0].content[1].image_url", ("messages", 0, "content", 1, "image_url", "url"))
        ]
        for text in ("a text", ["two", "texts"], [1, 2, 3], [[1, 2], [3]]):
            assert located(route, {"input": text}) == []


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("query", "documents"),
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ],
)
def test_score_inputs_are_read_in_every_pair_of_fields(first: str, second: str) -> None:
    """vLLM `ScoreInput` (a string, or `{"content": [parts]}` read with the chat part rules), alone or in a list, in
    `RerankRequest` and each `ScoreRequest` variant (vllm/entrypoints/pooling/scoring/protocol.py)."""
    document = {first: {"content": [IMG]}, second: ["text", {"content": [{"type": "text", "text": "t"}, IMG]}]}
    for route in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations"):
        assert located(route, document) == [
            (f"{first}.content[0].image_url", (first, "content", 0, "image_url", "url")),
            (f"{second}[1].content[1].image_url", (second, 1, "content", 1, "image_url", "url")),
        ]


def test_score_parts_follow_the_chat_rules() -> None:
    with pytest.raises(BadRequest, match=r"documents\[0\]\.content\[0\]: image_embeds parts are not supported"):
        find("/rerank", {"query": "q", "documents": [{"content": [{"type": "image_embeds", "image_embeds": "AA"}]}]})


def test_cohere_embed_images_and_inputs() -> None:
    """vLLM `CohereEmbedRequest`: `images` (each loaded as an `image_url`), `inputs[].content[]` parts."""
    document = {
        "images": ["data:image/png;base64,AAAA"],
        "inputs": [{"content": [{"type": "text", "text": "t"}, IMG]}],
    }
    assert refs("/v2/embed", document) == [
        (Modality.IMAGE, Source.DATA_URL, "images[0]", "data:image/png;base64,AAAA"),
        (Modality.IMAGE, Source.URL, "inputs[0].content[1].image_url", "https://e.com/i.png"),
    ]
    assert located("/v2/embed", document)[0] == ("images[0]", ("images", 0))


def test_structured_decision_media_lists() -> None:
    """vLLM `StructuredDecisionRequest`: `images`, `audio`, `videos`, lists of URLs or data URLs."""
    document = {"images": ["https://e.com/i.png"], "audio": ["data:audio/wav;base64,UklGRg=="], "videos": ["v.mp4"]}
    assert refs("/v1/systemone", document) == [
        (Modality.IMAGE, Source.URL, "images[0]", "https://e.com/i.png"),
        (Modality.AUDIO, Source.DATA_URL, "audio[0]", "data:audio/wav;base64,UklGRg=="),
        (Modality.VIDEO, Source.URL, "videos[0]", "v.mp4"),
    ]
    with pytest.raises(BadRequest, match=r"images\[0\] must be a url string"):
        find("/v1/systemone", {"images": [{"url": "https://e.com/i.png"}]})


def test_generate_content_parts_and_serialized_features() -> None:
    """vLLM `GenerateRequest.content_parts` (`ServingTokens`: `parse_image(url, uuid)` and the audio and video
    ones; no `url` refers to a cached item) and `features` (`kwargs_data` / `mm_metadata`: base64 of serialized
    `MultiModalKwargsItem`s, refused)."""
    document = {
        "content_parts": [
            {"type": "image_url", "url": "https://e.com/i.png"},
            {"type": "video_url", "url": "data:video/mp4;base64,AAAA"},
            {"type": "audio_url", "url": None, "uuid": "cached"},
            {"type": "text", "url": "https://e.com/not-media"},
        ]
    }
    assert refs("/inference/v1/generate", document) == [
        (Modality.IMAGE, Source.URL, "content_parts[0].url", "https://e.com/i.png"),
        (Modality.VIDEO, Source.DATA_URL, "content_parts[1].url", "data:video/mp4;base64,AAAA"),
    ]
    cached = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": []}, "kwargs_data": {"image": [None]}}
    assert find("/inference/v1/generate", {"features": cached}) == []
    for key in ("kwargs_data", "mm_metadata"):
        serialized = {**cached, key: {"image": ["gAR9lC4="]}}
        with pytest.raises(BadRequest, match=rf"features\.{key} on /inference/v1/generate is not supported") as e:
            find("/inference/v1/generate", {"features": serialized})
        assert e.value.reason == "unsupported_media"


def test_invocations_finds_every_shape_vllm_tries_on_it() -> None:
    """SageMaker `/invocations` (vllm/entrypoints/serve/sagemaker/api_router.py) validates the body against the chat,
    completion, embedding, classification, rerank, score and pooling request types in turn."""
    conversation = [{"role": "user", "content": [IMG]}]
    assert located("/invocations", {"messages": conversation}) == [
        ("messages[0].content[0].image_url", ("messages", 0, "content", 0, "image_url", "url"))
    ]
    assert located("/invocations", {"input": conversation}) == [
        ("input[0].content[0].image_url", ("input", 0, "content", 0, "image_url", "url"))
    ]
    assert located("/invocations", {"prompt": "text only"}) == []


def test_a_route_outside_the_table_is_read_in_every_shape_each_item_once() -> None:
    """An operator's own admission route (a prefixed path, say): every route's shapes, and an item that two shapes
    reach (a chat conversation in `input` is also a Responses input) counted once."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    document = {
        "input": [{"role": "user", "content": [IMG]}],
        "messages": [{"role": "user", "content": [image]}],
        "documents": [{"content": [IMG]}],
        "images": ["https://e.com/j.png"],
    }
    assert [locator for locator, _ in located("/api/v1/whatever", document)] == [
        "input[0].content[0].image_url",
        "messages[0].content[0].source",
        "documents[0].content[0].image_url",
        "images[0]",
    ]


def test_the_default_admission_routes_are_the_media_routes() -> None:
    from gateway.config import DEFAULT_ADMISSION_ROUTES, GatewaySettings
    from gateway.media_defaults import MEDIA_ROUTES

    assert tuple(MEDIA_ROUTES) == DEFAULT_ADMISSION_ROUTES
    assert GatewaySettings().limits.admission_routes == DEFAULT_ADMISSION_ROUTES


class Untouchable(list[Any]):
    """Token ids no finder may walk: iterating them fails the test."""

    def __iter__(self) -> Any:
        raise AssertionError("a list of token ids was walked")


def test_token_ids_and_texts_are_not_walked_item_by_item() -> None:
    """`input` and `messages` lists whose first item is no message (token ids, texts) are skipped whole: a body of
    millions of token ids costs the finders nothing."""
    ids = Untouchable([1, *range(100)])
    for document in ({"input": ids}, {"input": [ids, ids]}, {"messages": ids}, {"input": Untouchable(["a", "b"])}):
        for route in ("/v1/embeddings", "/pooling", "/invocations", "/v1/chat/completions/batch", "/tokenize"):
            assert find_media(route, ParsedBody(document, b"", [])) == []
