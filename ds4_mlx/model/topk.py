"""Top-k selection with ds4's tie rule: among equal scores the lower index wins.

Used by the router (experts) and the lightning indexer (compressed rows). `mx.argpartition` alone leaves ties
at the k-th place to the implementation, so the k-th largest value is found first and tied entries are
admitted in index order.
"""

from __future__ import annotations

import mlx.core as mx


def top_k_mask(scores: mx.array, k: int) -> mx.array:
    """Boolean mask of the k largest entries along the last axis; ties at the k-th value go to lower indices."""
    n = scores.shape[-1]
    if k >= n:
        return mx.ones(scores.shape, dtype=mx.bool_)
    kth = mx.partition(scores, n - k, axis=-1)[..., n - k : n - k + 1]
    above = scores > kth
    tied = scores == kth
    room = k - mx.sum(above, axis=-1, keepdims=True)
    return above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))


def mask_to_indices(mask: mx.array, k: int) -> mx.array:
    """Ascending indices of the (at most k) true entries of each row, padded with indices of false entries.

    Rows of `mask` with fewer than k true entries get false ones after them; callers gather `mask` at the
    returned indices to know which are real.
    """
    n = mask.shape[-1]
    index = mx.arange(n, dtype=mx.int32)
    key = mx.where(mask, index, index + n)
    chosen = mx.argpartition(key, k - 1, axis=-1)[..., :k] if k < n else mx.broadcast_to(index, mask.shape)
    return mx.sort(mx.take_along_axis(key, chosen, axis=-1), axis=-1) % n


def top_k_indices(scores: mx.array, k: int) -> mx.array:
    """Ascending indices of the k largest entries along the last axis (ties to the lower index)."""
    return mask_to_indices(top_k_mask(scores, k), k)
