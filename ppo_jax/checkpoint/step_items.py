"""What one checkpoint step holds: its Orbax items, by name, and what a restore of the newest valid
step returns. The state (arrays) and its checksums, the extra JSON, and optionally host arrays too
large for JSON (a partial rollout's KV cache), which a restore puts back into extra[ARRAYS_ITEM]."""

from __future__ import annotations

import dataclasses
from typing import Any

STATE_ITEM = "state"
EXTRA_ITEM = "extra"
CHECKSUM_ITEM = "checksums"
ARRAYS_ITEM = "host_arrays"  # optional: host arrays too large for the extra JSON (`save(arrays=)`)


@dataclasses.dataclass(frozen=True)
class RestoredStep:
    """What `restore_newest_valid` found: the newest step that verified, and why newer ones did not."""

    step: int
    state: Any
    extra: dict
    skipped: tuple[str, ...]  # one line per newer step found damaged (renamed <step>.corrupt), ready to print
