"""Finding the media items of a request, on every route whose body an upstream server reads media from: the OpenAI
chat, Responses and Anthropic Messages shapes, and the chat messages, score inputs and media lists of the tokenize,
pooling, scoring and other routes (`gateway.media_defaults.MEDIA_ROUTES`: which route carries which body shape).

The rules follow what the upstream servers load, not only what the OpenAI and Anthropic references document: a part
is media when an upstream would fetch or decode something for it. docs/admission.md ("Routes that read media" and
"Media shapes the gateway finds") lists every route and shape and what the gateway does with it. Each string taken
from the document goes through `ParsedBody.resolve`: in a large body a long literal is a placeholder until it is
resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from gateway.errors import BadRequest
from gateway.media.body import ParsedBody
from gateway.media_defaults import GENERATE_ROUTE, MEDIA_ROUTES, BodyShape


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
    # Keys from that content part to the string that holds the item (its URL, data URL or base64).
    value_key: tuple[str | int, ...] = ()

    @property
    def value_path(self) -> tuple[str | int, ...]:
        """Keys from the document's root to the string that holds the item."""
        return (*self.path, *self.value_key)


_UNSUPPORTED = "unsupported_media"

# A content part's media fields. A part whose `type` is missing (or that carries a `uuid`) is media when it holds
# one of these keys; the key names what is loaded.
_URL_KEYS: dict[str, Modality] = {
    "image_url": Modality.IMAGE,
    "video_url": Modality.VIDEO,
    "audio_url": Modality.AUDIO,
}
# Fields holding something the gateway cannot count before the upstream materializes it, and why.
_TENSOR = "a serialized tensor, whose memory cannot be known before it is loaded"
_UNCOUNTABLE_KEYS: dict[str, str] = {
    "image_embeds": _TENSOR,
    "audio_embeds": _TENSOR,
    "prompt_embeds": _TENSOR,
    "image_pil": "an in-process PIL image, which a JSON request cannot carry",
}
_MEDIA_KEYS = (*_URL_KEYS, "input_audio", *_UNCOUNTABLE_KEYS)
# Part types that name media, and the field each keeps it in.
_MEDIA_TYPES: dict[str, str] = {
    "image_url": "image_url",
    "input_image": "image_url",
    "video_url": "video_url",
    "audio_url": "audio_url",
    "input_audio": "input_audio",
    "image_embeds": "image_embeds",
    "audio_embeds": "audio_embeds",
    "prompt_embeds": "data",
    "image_pil": "image_pil",
}


def find_media(route: str, body: ParsedBody) -> list[MediaRef]:
    """The media items of a request on `route`; on a route `MEDIA_ROUTES` does not name (an operator's own
    admission route), every shape any route holds."""
    shape = MEDIA_ROUTES.get(route)
    finder = FINDERS[shape] if shape is not None else _find_every_shape
    document = body.document
    if not isinstance(document, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(document).__name__}")
    return list(finder(document, body))


def _find_chat(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    yield from _conversations(document.get("messages"), "messages", ("messages",), body)


def _conversations(value: Any, locator: str, path: tuple[str | int, ...], body: ParsedBody) -> Iterator[MediaRef]:
    """One conversation (a list of messages) or a batch of them (a list of such lists, as vLLM's batch chat and
    embeddings requests take). A list whose first item is neither is text or token ids (vLLM and trtllm-serve refuse
    a conversation holding anything but messages): it is not walked, however long."""
    if not isinstance(value, list) or not value:
        return
    if isinstance(value[0], list):
        for i, conversation in enumerate(value):
            if isinstance(conversation, list) and conversation and isinstance(conversation[0], dict):
                yield from _messages(conversation, f"{locator}[{i}]", (*path, i), body)
    elif isinstance(value[0], dict):
        yield from _messages(value, locator, path, body)


def _messages(messages: list[Any], locator: str, path: tuple[str | int, ...], body: ParsedBody) -> Iterator[MediaRef]:
    for m, message in enumerate(messages):
        # A string `content` is one text part; only a list holds media.
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from _parts(content, f"{locator}[{m}].content", (*path, m, "content"), body)


def _parts(parts: list[Any], locator: str, path: tuple[str | int, ...], body: ParsedBody) -> Iterator[MediaRef]:
    """A list of chat content parts; a string part is text."""
    for p, part in enumerate(parts):
        if isinstance(part, dict):
            ref = _content_part(part, f"{locator}[{p}]", body)
            if ref is not None:
                yield replace(ref, path=(*path, p))


def _content_part(part: dict[str, Any], locator: str, body: ParsedBody) -> MediaRef | None:
    """The media item an upstream loads for one content part (chat, or Responses content and outputs), if any.

    A part with a media `type` is media; so is a part with no `type`, or with a `uuid`, that holds a media field,
    and then the field names what is loaded. A part holding two media fields is refused: which one is loaded
    depends on the upstream.
    """
    kind = part.get("type")
    has_uuid = part.get("uuid") is not None
    media_type = kind if isinstance(kind, str) and kind in _MEDIA_TYPES else None
    if media_type is None and not (kind is None or has_uuid):
        return None  # text, or a type no upstream loads media for
    present = [key for key in _MEDIA_KEYS if key in part]
    if len(present) > 1:
        raise BadRequest(
            f"{locator} holds more than one media field ({', '.join(present)}); send one per content part",
            reason=_UNSUPPORTED,
        )
    if not present and media_type is None:
        return None
    key = present[0] if present else _MEDIA_TYPES[str(media_type)]
    uncountable = next((name for name in (media_type, key) if name in _UNCOUNTABLE_KEYS), None)
    if uncountable is not None:
        raise BadRequest(
            f"{locator}: {uncountable} parts are not supported by this gateway: {_UNCOUNTABLE_KEYS[uncountable]}",
            reason=_UNSUPPORTED,
        )
    if media_type == "input_image" and part.get("file_id") is not None:
        raise BadRequest(
            f"{locator}.file_id is not supported by this gateway; send the image as image_url",
            reason=_UNSUPPORTED,
        )
    here = f"{locator}.{key}"
    if key == "input_audio":
        return _input_audio(part.get(key), here, has_uuid, body)
    return _url_ref(_URL_KEYS[key], part.get(key), here, has_uuid, body, key)


def _url_ref(
    modality: Modality, holder: Any, locator: str, cached_ok: bool, body: ParsedBody, key: str
) -> MediaRef | None:
    # {"url": "..."} as OpenAI documents it, or the bare string.
    url, value_key = (holder.get("url"), (key, "url")) if isinstance(holder, dict) else (holder, (key,))
    if url is None and cached_ok:
        return None  # a reference to an item the upstream has cached: nothing is loaded
    if not isinstance(url, str):
        raise BadRequest(f"{locator} must hold a url string")
    return _url_item(modality, url, locator, body, value_key)


def _url_item(
    modality: Modality, url: str, locator: str, body: ParsedBody, value_key: tuple[str | int, ...]
) -> MediaRef:
    """The item a URL string names: a data URL, or one to download."""
    value = body.resolve(url)
    if value.startswith("data:") if isinstance(value, str) else bytes(value[:5]) == b"data:":
        return MediaRef(modality, Source.DATA_URL, locator, value, value_key=value_key)
    return MediaRef(modality, Source.URL, locator, _text(value), value_key=value_key)


def _input_audio(audio: Any, locator: str, cached_ok: bool, body: ParsedBody) -> MediaRef | None:
    data = audio.get("data") if isinstance(audio, dict) else None
    if not data and cached_ok:
        return None  # a reference to an item the upstream has cached: nothing is loaded
    if not isinstance(data, str):
        raise BadRequest(f"{locator}.data must be a base64 string")
    audio_format = audio.get("format") if isinstance(audio, dict) else None
    media_type = f"audio/{_text(body.resolve(audio_format))}" if isinstance(audio_format, str) else None
    return MediaRef(
        Modality.AUDIO, Source.BASE64, locator, body.resolve(data), media_type, value_key=("input_audio", "data")
    )


def _text(value: str | memoryview) -> str:
    """A resolved string as text; a view of the raw body holds a literal without escapes, so it is its UTF-8."""
    return value if isinstance(value, str) else bytes(value).decode("utf-8")


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
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise BadRequest(f"{locator}.source.url must be a string")
        return MediaRef(
            Modality.IMAGE, Source.URL, f"{locator}.source", _text(body.resolve(url)), value_key=("source", "url")
        )
    # A source without a type is read as base64, the way an upstream converting it to a data URL reads it.
    if kind == "base64" or kind is None:
        data = source.get("data")
        if not isinstance(data, str):
            raise BadRequest(f"{locator}.source.data must be a base64 string")
        media_type = source.get("media_type")
        return MediaRef(
            Modality.IMAGE,
            Source.BASE64,
            f"{locator}.source",
            body.resolve(data),
            _text(body.resolve(media_type)) if isinstance(media_type, str) else None,
            value_key=("source", "data"),
        )
    shown = _text(body.resolve(kind)) if isinstance(kind, str) else kind
    if isinstance(shown, str) and len(shown) > 40:
        shown = shown[:40] + "..."
    raise BadRequest(
        f"{locator}.source.type {shown!r} is not supported by this gateway; send the image as base64 or url",
        reason=_UNSUPPORTED,
    )


def _find_responses(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    items = document.get("input")
    if isinstance(items, list):
        yield from _responses_walk(items, "input", ("input",), body)


def _responses_walk(
    items: list[Any], locator: str, path: tuple[str | int, ...], body: ParsedBody
) -> Iterator[MediaRef]:
    # Input messages reach the upstreams' chat parsers, and so do the lists in function_call_output items:
    # every part in them is read with the chat rules.
    for i, item in enumerate(items):
        here = f"{locator}[{i}]"
        if not isinstance(item, dict):
            continue
        ref = _content_part(item, here, body)
        if ref is not None:
            yield replace(ref, path=(*path, i))
        for key in ("content", "output"):
            nested = item.get(key)
            if isinstance(nested, list):
                yield from _responses_walk(nested, f"{here}.{key}", (*path, i, key), body)


def _find_pooling(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    """vLLM's embeddings, pooling and classification requests: chat messages in `messages`, or in `input` (one
    conversation, or a batch, where `input` is a list of messages rather than text or token ids)."""
    yield from _find_chat(document, body)
    yield from _conversations(document.get("input"), "input", ("input",), body)


# The fields of vLLM's score and rerank requests that hold score inputs: a string, or {"content": [parts]}, alone or
# in a list (`ScoreInput | list[ScoreInput]`; the request's other fields pick which pair is read).
_SCORE_KEYS = ("query", "queries", "data_1", "text_1", "documents", "items", "data_2", "text_2")


def _find_score(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    for key in _SCORE_KEYS:
        value = document.get(key)
        inputs: list[tuple[str, tuple[str | int, ...], Any]] = (
            [(f"{key}[{i}]", (key, i), item) for i, item in enumerate(value)]
            if isinstance(value, list)
            else [(key, (key,), value)]
        )
        for locator, path, item in inputs:
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list):
                yield from _parts(content, f"{locator}.content", (*path, "content"), body)


def _url_list(document: dict[str, Any], key: str, modality: Modality, body: ParsedBody) -> Iterator[MediaRef]:
    """A list of URL strings (data URLs included), each one item."""
    values = document.get(key)
    if not isinstance(values, list):
        return
    for i, url in enumerate(values):
        if not isinstance(url, str):
            raise BadRequest(f"{key}[{i}] must be a url string")
        yield replace(_url_item(modality, url, f"{key}[{i}]", body, ()), path=(key, i))


def _find_cohere_embed(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    """Cohere's embed request: `images` (data URLs), or `inputs`, each a list of `text` and `image_url` parts."""
    yield from _url_list(document, "images", Modality.IMAGE, body)
    inputs = document.get("inputs")
    if isinstance(inputs, list):
        for i, item in enumerate(inputs):
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list):
                yield from _parts(content, f"inputs[{i}].content", ("inputs", i, "content"), body)


def _find_url_lists(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    """vLLM's structured-decision request: `images`, `audio` and `videos`, lists of URLs or data URLs."""
    yield from _url_list(document, "images", Modality.IMAGE, body)
    yield from _url_list(document, "audio", Modality.AUDIO, body)
    yield from _url_list(document, "videos", Modality.VIDEO, body)


_GENERATE_TYPES = {"image_url": Modality.IMAGE, "audio_url": Modality.AUDIO, "video_url": Modality.VIDEO}


def _find_generate(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    """vLLM's token-in generate request: `content_parts` of `{"type", "url", "uuid"}` (the server loads each URL; a
    part without one refers to a cached item); `features` carrying serialized multimodal tensors is refused."""
    features = document.get("features")
    if isinstance(features, dict):
        for key in ("kwargs_data", "mm_metadata"):
            payload = features.get(key)
            lists = payload.values() if isinstance(payload, dict) else ()
            if any(isinstance(item, str) for items in lists if isinstance(items, list) for item in items):
                raise BadRequest(
                    f"features.{key} on {GENERATE_ROUTE} is not supported by this gateway: it holds serialized "
                    f"multimodal tensors, {_TENSOR}; send the media as content_parts",
                    reason=_UNSUPPORTED,
                )
    parts = document.get("content_parts")
    if not isinstance(parts, list):
        return
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        modality = _GENERATE_TYPES.get(kind) if isinstance(kind, str) else None
        if modality is None or part.get("url") is None:
            continue  # text, or a reference to an item the upstream has cached
        url = part["url"]
        if not isinstance(url, str):
            raise BadRequest(f"content_parts[{i}].url must be a url string")
        yield replace(_url_item(modality, url, f"content_parts[{i}].url", body, ("url",)), path=("content_parts", i))


def _find_invocations(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    """SageMaker's `/invocations`: vLLM tries the chat, completion, embedding, classification, rerank, score and
    pooling request types in turn on the one body, so every one of their shapes is found."""
    yield from _find_pooling(document, body)
    yield from _find_score(document, body)


def _find_every_shape(document: dict[str, Any], body: ParsedBody) -> Iterator[MediaRef]:
    """Every shape of every route, each item once (a chat conversation in `input` is also a Responses input)."""
    seen: set[tuple[str | int, ...]] = set()
    for finder in _SHAPES:
        for ref in finder(document, body):
            if ref.value_path not in seen:
                seen.add(ref.value_path)
                yield ref


Finder = Callable[[dict[str, Any], ParsedBody], Iterator[MediaRef]]
_SHAPES: tuple[Finder, ...] = (
    _find_pooling,
    _find_messages,
    _find_responses,
    _find_score,
    _find_cohere_embed,
    _find_url_lists,
    _find_generate,
)

# Where each body shape holds its media (`MEDIA_ROUTES` says which routes carry which shape).
FINDERS: dict[BodyShape, Finder] = {
    BodyShape.CHAT: _find_chat,
    BodyShape.RESPONSES: _find_responses,
    BodyShape.MESSAGES: _find_messages,
    BodyShape.POOLING: _find_pooling,
    BodyShape.COHERE_EMBED: _find_cohere_embed,
    BodyShape.SCORE: _find_score,
    BodyShape.URL_LISTS: _find_url_lists,
    BodyShape.GENERATE: _find_generate,
    BodyShape.INVOCATIONS: _find_invocations,
}
