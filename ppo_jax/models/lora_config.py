"""LoRA's settings: which projections of a decoder carry adapters, of what rank and scale
(`ModelConfig.lora`). The adapters themselves are models/lora.py."""

from __future__ import annotations

import dataclasses
import math


# LoRA targets: our projection names (the Flax module names in layers.py / attention.py) per family.
TARGETS = {"gpt2": ("q", "k", "v", "o", "fc", "proj"), "llama": ("q", "k", "v", "o", "gate", "up", "down")}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapters of rank `rank` on the projections named in `targets` (our names, TARGETS).

    scale = alpha / rank, or alpha / sqrt(rank) with `rslora` (rank-stabilised LoRA, PEFT's
    use_rslora). param_dtype: the adapters' own dtype (float32 by default: they are the trainable
    master weights even when the frozen base is bf16).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    rslora: bool = False
    param_dtype: str = "float32"

    def __post_init__(self):
        # A tuple whatever a config file gave (a list): the config must stay hashable.
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0: LoRA off), got {self.rank}")
        if not self.targets:
            raise ValueError("lora.targets is empty; name at least one projection")
        known = sorted(set(TARGETS["gpt2"]) | set(TARGETS["llama"]))
        unknown = [t for t in self.targets if t not in known]
        if unknown:
            raise ValueError(f"lora.targets has unknown projections {unknown}; use some of {known}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets names a projection twice: {list(self.targets)}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be positive, got {self.alpha}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check_family(self, family: str):
        """Refuses targets the family's blocks do not have (GPT-2 has no gate/up/down)."""
        missing = [t for t in self.targets if t not in TARGETS[family]]
        if missing:
            raise ValueError(f"lora.targets {missing} name projections a {family} model does not have; "
                             f"its projections are {list(TARGETS[family])}")
