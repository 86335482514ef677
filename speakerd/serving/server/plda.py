"""VBx's PLDA (`--plda`): resolved and loaded before listening, or not at all.

Diarize's `clustering.method` vbx (pyannote/speaker-diarization-community-1's clustering)
clusters the embeddings in a PLDA space, and that PLDA is a pair of files, not something a
server can make up: without `--plda` the server has none and answers vbx with
FAILED_PRECONDITION. Given, it is resolved (a local directory, or a hub repo's `plda/`
folder fetched into the Hugging Face cache: model/source.py), loaded and checked once, in
preflight, so a file that is not a PLDA, or one for embeddings of another size, is one line
naming the flag and exit 2 before the port opens.
"""

from __future__ import annotations

import logging

from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.model.diarization.plda import PLDA_FILE, TRANSFORM_FILE, Plda, PldaError, load_plda
from speakerd.model.source import ModelError, ResolvedPlda, resolve_plda
from speakerd.serving.server.config import UsageError

log = logging.getLogger(__name__)

FLAG = "--plda"
#: What the flag takes, said after whatever went wrong.
EXPECTED = (
    f"give pyannote's PLDA: a directory holding {TRANSFORM_FILE} and {PLDA_FILE}, or a repo id whose "
    "plda/ folder holds them, like pyannote/speaker-diarization-community-1"
)


def prepare(spec: str) -> tuple[ResolvedPlda, Plda]:
    """The PLDA of `spec`, resolved (downloaded and cached as needed) and loaded; UsageError
    naming the flag otherwise. Its input must be the served model's embeddings (256)."""
    try:
        resolved = resolve_plda(spec, FLAG)
    except ModelError as error:
        raise UsageError(str(error)) from error
    try:
        plda = load_plda(resolved.directory)
    except PldaError as error:
        raise UsageError(f"{FLAG} {spec}: {error}; {EXPECTED}") from error
    if plda.embedding_dimension != EMBEDDING_DIM:
        raise UsageError(
            f"{FLAG} {spec}: the PLDA transforms {plda.embedding_dimension}-dimensional embeddings, the "
            f"served model's are {EMBEDDING_DIM}-dimensional; {EXPECTED}"
        )
    where = f"{resolved.source.repo_id}@{resolved.source.revision}" if resolved.source.repo_id else "local"
    log.info("PLDA %s (%s, %s): %d -> %d dimensions; Diarize takes clustering.method vbx",
             resolved.plda_id[:16], where, resolved.directory, plda.embedding_dimension,
             plda.lda_dimension)  # fmt: skip
    return resolved, plda
