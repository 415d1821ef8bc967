"""What a request keeps of its media items (`Keep`, chosen once per request) and each item's route through its load
(`ItemPlan`).

The plans are made before anything is reserved (`MediaLoader.plan`), handed through the prediction of the
reservation's size (`MediaLoader.predict`, which returns them with what it opened) and consumed by the load
(`MediaLoader.load`): what an item's load does follows from its plan and its bytes, nothing else. Each modality's
plan may say more (an image's: what was opened for the prediction, where it is opened and checked).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.media.parts import MediaRef
from gateway.media.resize import ModelResize
from processor_geometry import ProcessorGeometry


@dataclass(frozen=True, slots=True)
class Keep:
    """What a request keeps of each of its items once it is counted; the default keeps nothing."""

    resize: ModelResize | None = None
    """Engine mode: the item's pixels resized for the engine's model (`LoadedItem.resized`). Every item is decoded,
    and what is charged is those pixels, not the tensors an upstream processor would make of it."""
    downloads: bool = False
    """A downloaded item's bytes as checked (`LoadedItem.downloaded`), forwarded in place of its URL
    (`media.fetch.forward: inline`)."""

    @property
    def geometry(self) -> ProcessorGeometry | None:
        """The engine model's geometry the pixels are resized to (engine mode), else None."""
        return self.resize.geometry if self.resize is not None else None


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """One item's route through its load, fixed before the load starts."""

    ref: MediaRef
    keep: Keep
    """The request's: the same for each of its items."""
    sole: bool
    """The request's only item, loaded in the request's own task: small work on it may run on the event loop's
    thread (gateway/media/threads.py), within its loader's bounds. An item of a request with several never does,
    so that what one request runs there is one item's bounded work."""
