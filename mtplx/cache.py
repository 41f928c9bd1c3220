"""Rolling caches back past rejected draft tokens.

Attention KV caches are trimmable: dropping the last n entries is exact. Recurrent state
(linear attention, gated-delta, Mamba layers) cannot be trimmed, so a checkpoint keeps a
reference to it before a speculative forward; MLX arrays are immutable and mlx-lm's caches
replace (not mutate) their state arrays, so holding the old references is a free snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def is_trimmable(cache: list[Any]) -> bool:
    """True when every layer cache can drop its last entries exactly."""
    return all(layer.is_trimmable() for layer in cache)


def cache_length(cache: list[Any]) -> int:
    """Committed length of a sequence's cache: the largest offset among its KV layers (0 for
    a purely recurrent cache)."""
    return max((layer.size() for layer in cache if layer.is_trimmable()), default=0)


def trim(cache: list[Any], num_tokens: int) -> None:
    """Drop the last ``num_tokens`` entries of every (trimmable) layer cache."""
    if num_tokens <= 0:
        return
    for layer in cache:
        if not layer.is_trimmable():
            raise ValueError(f"{type(layer).__name__} cannot be trimmed; use a checkpoint")
        layer.trim(num_tokens)


@dataclass(frozen=True)
class CacheCheckpoint:
    """A point a cache can be rolled back to: KV offsets and recurrent state references."""

    offsets: tuple[int | None, ...]  # per layer: KV length, None for a recurrent layer
    states: tuple[Any, ...]  # per layer: the recurrent layer's state, None for a KV layer


def checkpoint(cache: list[Any]) -> CacheCheckpoint:
    """Remember where ``cache`` is now, to roll back to after a speculative forward."""
    offsets: list[int | None] = []
    states: list[Any] = []
    for layer in cache:
        if layer.is_trimmable():
            offsets.append(layer.size())
            states.append(None)
        else:
            offsets.append(None)
            states.append(_copy_state(layer))
    return CacheCheckpoint(tuple(offsets), tuple(states))


def rollback(cache: list[Any], point: CacheCheckpoint) -> None:
    """Return ``cache`` to ``point``: trim KV layers, restore recurrent state."""
    for layer, offset, state in zip(cache, point.offsets, point.states, strict=True):
        if offset is not None:
            layer.trim(layer.size() - offset)
        else:
            _restore_state(layer, state)


def snapshot(layer: Any) -> Any:
    """The state of one recurrent layer cache, to ``restore`` into a layer of the same kind
    (another sequence's, for the prefix cache)."""
    return _copy_state(layer)


def restore(layer: Any, saved: Any) -> None:
    """Set a recurrent layer cache to a ``snapshot``."""
    _restore_state(layer, saved)


def _copy_state(layer: Any) -> Any:
    """A snapshot of a non-trimmable layer cache: its attributes, with lists copied (mlx-lm's
    ArraysCache replaces list items in place). Sound because these caches rebind arrays
    rather than write into them."""
    if hasattr(layer, "caches"):  # CacheList of sub-caches
        return ("caches", [_copy_state(sub) for sub in layer.caches])
    return (
        "attributes",
        {
            name: list(value) if isinstance(value, list) else value
            for name, value in vars(layer).items()
        },
    )


def _restore_state(layer: Any, saved: Any) -> None:
    kind, value = saved
    if kind == "caches":
        for sub, sub_saved in zip(layer.caches, value, strict=True):
            if sub.is_trimmable():
                raise ValueError("mixed trimmable/recurrent CacheList is not supported")
            _restore_state(sub, sub_saved)
        return
    attributes = vars(layer)
    attributes.clear()
    attributes.update({n: list(v) if isinstance(v, list) else v for n, v in value.items()})
