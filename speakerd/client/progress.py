"""Progress of a long call on stderr: `speakerd-client diarize`'s windows done of the total.

Shown only once a call has taken SHOW_AFTER_S, so a short call prints nothing beside its
answer. On a terminal it is one line rewritten in place (and cleared at the end); piped or
redirected, a line every LINE_EVERY_S, so a log keeps a few lines rather than hundreds.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Progress:
    """Where a Diarize call is (DiarizeProgress): `stage` "embedding" (windows segmented and
    embedded as the audio arrives: `windows_done` of `windows`, 0 while the total is unknown)
    or "clustering" (after the last window); seconds since the server had the header."""

    stage: str
    windows_done: int
    windows: int
    elapsed_s: float


#: A call shorter than this shows no progress at all.
SHOW_AFTER_S = 3.0
#: Seconds between two lines where stderr is not a terminal.
LINE_EVERY_S = 10.0


class ProgressLine:
    """Prints Progress updates for the command `name` on `stream` (stderr by default)."""

    def __init__(self, name: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.name = name
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self.started = time.monotonic()
        self.last_line = 0.0
        self.shown = False

    def update(self, progress: Progress) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.started < SHOW_AFTER_S:
            return
        if not self.terminal and self.shown and now - self.last_line < LINE_EVERY_S:
            return
        text = f"{self.name}: {describe(progress)}"
        if self.terminal:
            self.stream.write(f"\r\x1b[K{text}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown, self.last_line = True, now

    def close(self) -> None:
        """Clear the terminal's line, so the answer starts on a clean one."""
        if self.enabled and self.terminal and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def describe(progress: Progress) -> str:
    """'1,234 of 3,591 windows segmented and embedded (34%), 12.3 s' or 'clustering 3,591
    windows, 14.0 s'."""
    if progress.stage == "clustering":
        return f"clustering {progress.windows_done:,} windows, {progress.elapsed_s:.1f} s"
    done = f"{progress.windows_done:,}"
    if progress.windows > 0:
        share = 100 * progress.windows_done // progress.windows
        done += f" of {progress.windows:,} windows segmented and embedded ({share}%)"
    else:
        done += " windows segmented and embedded"
    return f"{done}, {progress.elapsed_s:.1f} s"
