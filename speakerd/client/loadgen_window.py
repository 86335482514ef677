"""The counted window of `client load`: calls begin from the start line until the window's
end, and those begun inside it count (loadgen.py says why a warm-up comes first). Counting
calls begun, not ended, in the window: in a steady state both give the rate, and a window
shorter than one call still counts each stream's first call when there is no warm-up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """When a stream calls (it begins calls until `end`) and which calls it counts (those
    begun in [`start`, `end`)), in time.monotonic() seconds of its process."""

    start: float
    end: float

    @classmethod
    def after(cls, now: float, warmup_s: float, seconds: float) -> Window:
        return cls(now + warmup_s, now + warmup_s + seconds)

    def counts(self, begun: float) -> bool:
        return self.start <= begun < self.end
