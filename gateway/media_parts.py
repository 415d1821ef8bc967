"""Finding the media items of a request, in the OpenAI chat, OpenAI Responses and Anthropic Messages shapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from gateway.body_parse import ParsedBody
from gateway.errors import BadRequest


class Modality(StrEnum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


class Source(StrEnum):
    DATA_URL = "data_url"
    BASE64 = "base64"
    URL = "url"


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media item as the request names it. `locator` says where, for error messages."""

    modality: Modality
    source: Source
    locator: str
    value: str | memoryview
    media_type: str | None = None
    # Keys from the document's root to the content part that holds the item.
    path: tuple[str | int, ...] = ()


def find_media(route: str, body: ParsedBody) -> list[MediaRef]:
    finder = _FINDERS.get(route, _find_chat)
    document = body.document
    if not isinstance(document, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(document).__name__}")
    return list(finder(document, body))


def _find_chat(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    messages = document.get("messages")
    if not isinstance(messages, list):
        return
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if isinstance(part, dict):
                ref = _chat_part(part, f"messages[{m}].content[{p}]", body)
                if ref is not None:
                    yield replace(ref, path=("messages", m, "content", p))


def _chat_part(part: dict[str, Any], locator: str, body: ParsedBody) -> MediaRef | None:
    kind = part.get("type")
    if kind == "image_url":
        return _url_ref(Modality.IMAGE, part.get("image_url"), f"{locator}.image_url", body)
    if kind == "video_url":
        return _url_ref(Modality.VIDEO, part.get("video_url"), f"{locator}.video_url", body)
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        if not isinstance(data, str):
            raise BadRequest(f"{locator}.input_audio.data must be a base64 string")
        audio_format = audio.get("format") if isinstance(audio, dict) else None
        media_type = f"audio/{audio_format}" if isinstance(audio_format, str) else None
        return MediaRef(Modality.AUDIO, Source.BASE64, f"{locator}.input_audio", body.resolve(data), media_type)
    return None


def _url_ref(modality: Modality, holder: Any, locator: str, body: ParsedBody) -> MediaRef:
    # {"url": "..."} as OpenAI documents it, or the bare string vLLM also accepts.
    url = holder.get("url") if isinstance(holder, dict) else holder
    if not isinstance(url, str):
        raise BadRequest(f"{locator} must hold a url string")
    value = body.resolve(url)
    is_data = value[:5] == "data:" if isinstance(value, str) else bytes(value[:5]) == b"data:"
    return MediaRef(modality, Source.DATA_URL if is_data else Source.URL, locator, value)


def _find_messages(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    messages = document.get("messages")
    if not isinstance(messages, list):
        return
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from _anthropic_blocks(content, f"messages[{m}].content", ("messages", m, "content"), body)


def _anthropic_blocks(
    blocks: list[Any], locator: str, path: tuple[str | int, ...], body: ParsedBody
) -> Iterator[MediaRef]:
    for b, block in enumerate(blocks):
        if not isinstance(block, dict):
            continue
        here = f"{locator}[{b}]"
        kind = block.get("type")
        if kind == "image":
            yield replace(_anthropic_image(block.get("source"), here, body), path=(*path, b))
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            yield from _anthropic_blocks(block["content"], f"{here}.content", (*path, b, "content"), body)


def _anthropic_image(source: Any, locator: str, body: ParsedBody) -> MediaRef:
    if not isinstance(source, dict):
        raise BadRequest(f"{locator}.source must be an object")
    kind = source.get("type")
    if kind == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise BadRequest(f"{locator}.source.data must be a base64 string")
        media_type = source.get("media_type")
        return MediaRef(
            Modality.IMAGE,
            Source.BASE64,
            f"{locator}.source",
            body.resolve(data),
            media_type if isinstance(media_type, str) else None,
        )
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise BadRequest(f"{locator}.source.url must be a string")
        return MediaRef(Modality.IMAGE, Source.URL, f"{locator}.source", url)
    raise BadRequest(
        f"{locator}.source.type {kind!r} is not supported by this gateway; send the image as base64 or url",
        reason="unsupported_media",
    )


def _find_responses(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    items = document.get("input")
    if isinstance(items, list):
        yield from _responses_walk(items, "input", ("input",), body)


def _responses_walk(
    items: list[Any], locator: str, path: tuple[str | int, ...], body: ParsedBody
) -> Iterator[MediaRef]:
    for i, item in enumerate(items):
        here = f"{locator}[{i}]"
        if not isinstance(item, dict):
            continue
        if item.get("type") == "input_image":
            yield replace(_responses_image(item, here, body), path=(*path, i))
        for key in ("content", "output"):
            nested = item.get(key)
            if isinstance(nested, list):
                yield from _responses_walk(nested, f"{here}.{key}", (*path, i, key), body)


def _responses_image(item: dict[str, Any], locator: str, body: ParsedBody) -> MediaRef:
    if item.get("file_id") is not None:
        raise BadRequest(
            f"{locator}.file_id is not supported by this gateway; send the image as image_url",
            reason="unsupported_media",
        )
    url = item.get("image_url")
    if not isinstance(url, str):
        raise BadRequest(f"{locator}.image_url must be a string")
    return _url_ref(Modality.IMAGE, url, f"{locator}.image_url", body)


_FINDERS: dict[str, Callable[[dict[str, Any], ParsedBody], Iterator[MediaRef]]] = {
    "/v1/chat/completions": _find_chat,
    "/v1/messages": _find_messages,
    "/v1/responses": _find_responses,
}
