"""Turns -> RTTM text, byte for byte what pyannote.core's `Annotation.write_rttm` writes.

RTTM is the exchange format of diarization scorers (NIST md-eval, pyannote.metrics,
dscore): one line per turn, `SPEAKER <uri> 1 <start> <duration> <NA> <NA> <speaker> <NA>
<NA>`, times in seconds with three decimals (Python's `.3f`, round-half-even on the
binary value), channel 1. Fields are separated by spaces, so a uri or speaker name holding
one is refused, as pyannote refuses it (a name that is no pyannote label goes through
`rttm_field` first); a missing uri is written `<NA>`.
"""

from __future__ import annotations

from collections.abc import Iterable

from speakerd.model.diarization.turns import Turn

#: What RTTM writes for an unknown uri (and in its unused fields).
NOT_AVAILABLE = "<NA>"
#: pyannote writes every turn on channel 1.
CHANNEL = 1


def rttm_lines(turns: Iterable[Turn], uri: str | None) -> list[str]:
    """One RTTM line (with its newline) per turn, in the order given."""
    name = uri if uri else NOT_AVAILABLE
    if " " in name:
        raise ValueError(f'RTTM fields are space-separated: the uri "{name}" holds a space')
    lines = []
    for turn in turns:
        if " " in turn.speaker:
            raise ValueError(f'RTTM fields are space-separated: the speaker "{turn.speaker}" holds a space')
        lines.append(
            f"SPEAKER {name} {CHANNEL} {turn.start:.3f} {turn.duration:.3f} "
            f"{NOT_AVAILABLE} {NOT_AVAILABLE} {turn.speaker} {NOT_AVAILABLE} {NOT_AVAILABLE}\n"
        )
    return lines


def rttm_field(text: str) -> str:
    """`text` as one RTTM field: each run of whitespace an underscore ("Alice Smith" ->
    "Alice_Smith"), for names that are not pyannote's labels (voiceprints' speaker ids)."""
    return "_".join(text.split())


def to_rttm(turns: Iterable[Turn], uri: str | None) -> str:
    """The RTTM text of `turns` (`Annotation.to_rttm`)."""
    return "".join(rttm_lines(turns, uri))
