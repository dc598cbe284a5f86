"""Examples packed on the host: a step's left-padded batch [B, L] as fewer, longer rows [R, T] (SFT
examples; a preference batch's chosen and rejected sequences).

A padded SFT batch pays its forward and backward for every padding slot; the demo's corpus fills 53%
of its 34-slot rows. Packing moves each example's real tokens, in order, into R rows of T slots
(first-fit decreasing, longest first), several examples per row: `segment_ids` name each slot's
example (0 on padding), `positions` restart at 0 for each, and the model attends only within an
example (`models/attention.attention_mask`). The loss is the same token mean over the same targets,
so a packed step computes the padded step's loss and gradient up to float round-off
(`tests/test_host_packing.py`); a reward model reads each sequence's score at its last slot
(`PackedPairs.last_slots`).

The packing is done here, per batch, in NumPy, because only the host knows the lengths before the
step: the rows' shape [R, T] is fixed by the settings (one compiled step), and a batch whose examples
do not fit in R rows is returned as None, for the caller to run padded (a second compiled step, the
same arithmetic). Which slots an example takes depends on that batch only, so a resumed run packs
every batch as the straight run did.
"""

from __future__ import annotations

import flax.struct
import numpy as np

from ppo_jax.data.tokenization import PreferenceBatch, SFTBatch


@flax.struct.dataclass
class PackedSFTBatch:
    """Examples packed into rows; every array [R, T] int32.

    tokens: the examples' real tokens, back to back; 0 on padding. mask: 1 on a real token.
    loss_mask: 1 where the token is a target (a response token or its EOS), as `SFTBatch.loss_mask`;
    0 on each example's first slot, which has no predecessor of its own. positions: a token's place in
    its example. segment_ids: 1 + the example's row in the padded batch; 0 on padding.
    """

    tokens: np.ndarray
    mask: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray


def first_fit_decreasing(lengths: np.ndarray, num_rows: int, row_length: int) -> np.ndarray | None:
    """[B] lengths -> [B] (row, offset) pairs as a [B, 2] int array: each length, longest first (ties in
    order), into the first row with room. None when some length finds no row."""
    used = np.zeros(num_rows, np.int64)
    placed = np.zeros((len(lengths), 2), np.int64)
    for i in np.argsort(-lengths, kind="stable"):
        rows = np.flatnonzero(used + lengths[i] <= row_length)
        if rows.size == 0:
            return None
        row = rows[0]
        placed[i] = (row, used[row])
        used[row] += lengths[i]
    return placed


def _pack(tokens: np.ndarray, mask: np.ndarray, num_rows: int, row_length: int, **per_token: np.ndarray
          ) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """Left-padded rows tokens, mask [N, L] (and any other per_token [N, L] arrays, moved alike) into
    [num_rows, row_length]: (the packed arrays by name, with mask, positions and segment_ids; each
    row's flat first slot [N]). None if they do not fit."""
    real = np.asarray(mask).astype(bool)
    lengths = real.sum(axis=1)
    placed = first_fit_decreasing(lengths, num_rows, row_length)
    if placed is None:
        return None
    shape = (num_rows, row_length)
    sources = {"tokens": np.asarray(tokens), **{k: np.asarray(v) for k, v in per_token.items()}}
    out = {name: np.zeros(shape, np.int32) for name in (*sources, "mask", "positions", "segment_ids")}
    for b, (row, offset) in enumerate(placed):
        where = (row, slice(offset, offset + lengths[b]))
        for name, values in sources.items():
            out[name][where] = values[b][real[b]]
        out["mask"][where] = 1
        out["positions"][where] = np.arange(lengths[b])
        out["segment_ids"][where] = b + 1
    return out, placed[:, 0] * row_length + placed[:, 1]


def pack_sft(batch: SFTBatch, num_rows: int, row_length: int) -> PackedSFTBatch | None:
    """A left-padded SFT batch [B, L] packed into [num_rows, row_length]; None if it does not fit.

    Every example keeps its real tokens in order and contiguous (row_length >= L, so each fits a row
    of its own); the slots after a row's last example are padding.
    """
    packed = _pack(batch.tokens, batch.mask, num_rows, row_length, loss_mask=batch.loss_mask)
    if packed is None:
        return None
    out, first = packed
    out["loss_mask"].reshape(-1)[first[np.asarray(batch.mask).any(axis=1)]] = 0  # predicted by nothing of its own
    return PackedSFTBatch(**out)


@flax.struct.dataclass
class PackedPairs:
    """A preference batch's B chosen and B rejected sequences packed into rows; arrays [R, T] int32
    as `PackedSFTBatch`'s (segment_ids: 1 + the sequence's row in [chosen; rejected], [2B]), and
    last_slots [2B] int32: the flat slot (row * T + offset) of each sequence's last token, where a
    scalar head's score is read, the chosen first."""

    tokens: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    last_slots: np.ndarray


def pack_pairs(batch: PreferenceBatch, num_rows: int, row_length: int) -> PackedPairs | None:
    """A preference batch's 2B sequences [2B, L] packed into [num_rows, row_length]; None if they do
    not fit. Every sequence has a token (its prompt's)."""
    mask = np.concatenate([batch.chosen_mask, batch.rejected_mask])
    packed = _pack(np.concatenate([batch.chosen_tokens, batch.rejected_tokens]), mask, num_rows, row_length)
    if packed is None:
        return None
    out, first = packed
    return PackedPairs(**out, last_slots=(first + mask.sum(axis=1) - 1).astype(np.int32))
