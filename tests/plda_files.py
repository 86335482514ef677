"""A random but valid PLDA in pyannote's layout, for the tests that need one.

community-1's real PLDA is in a gated hub repo that the tests cannot reach, so they write
one of the same shapes: `xvec_transform.npz` (mean1, mean2, lda) and `plda.npz` (mu, tr,
psi), the two files pyannote's `PLDA.from_pretrained(directory)` and speakerd's
`load_plda(directory)` read. NumPy only, so tests without pyannote.audio can use it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

#: community-1's dimensions: ResNet embeddings of 256, an LDA to 128, PLDA of 128.
EMBEDDING_DIM = 256
LDA_DIM = 128


def write_plda(
    directory: Path, seed: int, dtype: Any = np.float64, dim_in: int = EMBEDDING_DIM, dim_out: int = LDA_DIM
) -> Path:
    """xvec_transform.npz and plda.npz of a random but valid model in `directory` (made if
    needed): an LDA with orthonormal columns, a well-conditioned tr, positive psi spread over
    three decades (a few strong speaker directions, many weak, as in a trained PLDA)."""
    rng = np.random.default_rng(seed)
    lda = np.linalg.qr(rng.standard_normal((dim_in, dim_out)))[0]
    tr = np.linalg.qr(rng.standard_normal((dim_out, dim_out)))[0] * rng.uniform(0.5, 2.0, size=(dim_out, 1))
    psi = np.sort(10 ** rng.uniform(-1.0, 2.0, size=dim_out))[::-1]
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(
        directory / "xvec_transform.npz",
        mean1=(0.05 * rng.standard_normal(dim_in)).astype(dtype),
        mean2=(0.05 * rng.standard_normal(dim_out)).astype(dtype),
        lda=lda.astype(dtype),
    )
    np.savez(
        directory / "plda.npz",
        mu=(0.05 * rng.standard_normal(dim_out)).astype(dtype),
        tr=tr.astype(dtype),
        psi=psi.astype(dtype),
    )
    return directory
