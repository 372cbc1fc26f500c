"""KV cache groups: layers that share one block table per request.

A model whose layers all see the whole context needs one block table per request: block i
holds tokens i * block_size .. of every layer. A model with sliding-window layers (Gemma 3:
five layers in six see only the last 512 keys) should not keep those layers' KV beyond the
window, yet its global layers need every block. So layers are grouped by window, and each
group gets its own block table per request; a sliding-window group hands blocks that its
window can no longer reach back to the pool as the sequence grows.

All groups draw from one pool of equal blocks (vLLM's hybrid allocator): every group has
the same number of layers, and a physical block holds ``layers_per_group`` layers' KV for
``block_size`` tokens. Block b of group g lives at index b of the group's layers' tensors,
which the runner allocates once per position in a group (layer j of every group shares the
``j``-th tensor), so memory is split between full and sliding layers by what requests
actually hold, never by a fixed ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layer indices, ascending
    window: int | None  # keys a query sees, ending at its own position (None: all)


def group_layers(windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """Groups of equal size for layers with these windows (one entry per layer).

    1. Layers with the same window form a class; the group size is the greatest common
       divisor of the class sizes, so every class splits into whole groups.
    2. Each class is cut into groups of that size in layer order; groups are ordered by
       their first layer. A model without sliding windows gets one group of every layer.
    """
    if not windows:
        raise ValueError("a model has at least one layer")
    classes: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding window must be at least 1, got {window}")
        classes.setdefault(window, []).append(layer)
    size = 0
    for layers in classes.values():
        size = gcd(size, len(layers))
    groups = [KVCacheGroup(tuple(layers[i:i + size]), window)
              for window, layers in classes.items() for i in range(0, len(layers), size)]
    return sorted(groups, key=lambda g: g.layers[0])


def first_needed_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a sequence still needs when its next query is at ``num_computed``:
    that query sees keys from ``num_computed - window + 1`` on, and every later query sees
    no earlier key (0 for a layer without a window)."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def blocks_per_sequence(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int,
                        step_tokens: int | None = None) -> int:
    """Blocks one sequence of ``num_tokens`` holds across all groups, at most.

    A sliding-window group holds the blocks of its window plus those of the tokens one step
    computes (all of a step's keys are written before its queries read them), so
    ``step_tokens`` (the most a step schedules; None: the whole sequence at once) bounds
    it. A full group holds every block of the sequence.
    """
    full = -(-num_tokens // block_size)
    total = 0
    for g in groups:
        if g.window is None:
            total += full
        else:
            step = num_tokens if step_tokens is None else min(step_tokens, num_tokens)
            # Queries from s to s + step - 1 need keys s - window + 1 ..; one block more
            # where that span does not start on a block boundary.
            total += min(full, -(-(g.window - 1 + step) // block_size) + 1)
    return total
