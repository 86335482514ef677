"""The counted window of `client load`, and what its exit status means (outcome).

Calls begin from the start line until the window's end, and those begun inside it count
(loadgen.py says why a warm-up comes first). Counting calls begun, not ended, in the
window: in a steady state both give the rate, and a window shorter than one call still
counts each stream's first call when there is no warm-up."""

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


def outcome(completed: int, errors: dict[str, int], seconds: float) -> dict[str, object]:
    """What `client load`'s exit status means, in its JSON: `ok` (exit 0) when no call failed
    and at least one call begun in the counted window completed; else exit 1 and `failure`
    says which of the two it was (`failed_calls` counts the failures by their codes in
    `errors`)."""
    failed = sum(errors.values())
    failure = None
    if failed:
        codes = ", ".join(f"{code} {count}" for code, count in sorted(errors.items()))
        failure = f"{failed} calls failed ({codes})"
    elif completed == 0:
        failure = (
            f"no call began in the {seconds:g} s counted window (the calls begun before it outlasted "
            "it): raise --seconds, or lower --chunks or --recording"
        )
    return {"failed_calls": failed, "ok": failure is None, "failure": failure}
