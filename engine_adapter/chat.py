"""The chat completion document a submit carries: where its media items sit, and its text.

In the submit format (`engine_adapter.client.wire`) every media part of the request became
`{"type": "mmgate_item", "index": i}`; the hand-off backends put each item's embeddings back in its place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from engine_adapter.client.wire import ITEM_PART_TYPE


def _content_lists(document: dict[str, Any]) -> Iterator[list[Any]]:
    messages = document.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            yield message["content"]


def item_indices(document: dict[str, Any]) -> list[object]:
    """The `index` of every item part, in document order (not validated)."""
    return [
        part.get("index")
        for content in _content_lists(document)
        for part in content
        if isinstance(part, dict) and part.get("type") == ITEM_PART_TYPE
    ]


def check_item_parts(document: dict[str, Any], num_items: int) -> None:
    """ValueError unless the item parts are exactly indices 0..num_items-1, each once."""
    indices = item_indices(document)
    ints = [i for i in indices if type(i) is int]  # not bool, which is an int subclass
    if len(ints) != len(indices) or sorted(ints) != list(range(num_items)):
        raise ValueError(
            f"the request's {ITEM_PART_TYPE} parts have indices {indices}, "
            f"but the file carries {num_items} item(s): each index 0..{num_items - 1} must appear exactly once"
        )


def replace_item_parts(document: dict[str, Any], make_part: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """A copy of `document` with each item part replaced by `make_part(index)`; the input is not modified.

    Only the message list and the content lists that hold item parts are copied; everything else is shared.
    """
    messages = document.get("messages")
    if not isinstance(messages, list):
        return dict(document)
    copied: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(_is_item(part) for part in content):
            parts = [make_part(int(part["index"])) if _is_item(part) else part for part in content]
            message = {**message, "content": parts}
        copied.append(message)
    return {**document, "messages": copied}


def _is_item(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == ITEM_PART_TYPE


def text_tokens(document: dict[str, Any]) -> int:
    """Whitespace-separated words in the messages' text: the reference responder's token count."""
    messages = document.get("messages")
    if not isinstance(messages, list):
        return 0
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            count += len(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    count += len(part["text"].split())
    return count
