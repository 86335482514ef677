"""pyannote's PLDA as plain arrays: the space VBx clusters x-vectors in.

pyannote.audio 4.0.7's `VBxClustering` (speaker-diarization-community-1's clustering) does
not cluster the embeddings themselves: it maps them into a PLDA latent space where speakers
differ along independent directions, each with its own between-speaker variance, and the
within-speaker variance is one. Two NumPy archives describe that map (pyannote's
core/plda.py and utils/vbx.py `vbx_setup` read them the same way):

- `xvec_transform.npz`: `mean1` [D], `lda` [D, L], `mean2` [L]. An embedding is centred on
  `mean1`, L2-normalised and scaled to norm sqrt(D), projected by `lda`, centred on `mean2`,
  and normalised again to norm sqrt(L) (the x-vector recipe of Kaldi/VBx, D 256 and L 128
  for community-1's ResNet).
- `plda.npz`: `mu` [L], `tr` [L, L], `psi` [L]: a PLDA model in Kaldi's form, where `tr`
  whitens the within-speaker covariance and `psi` is the between-speaker variance in that
  basis. The loader re-derives the basis VBx wants from the within (W) and between (B)
  covariances by the generalised eigenproblem B v = λ W v, eigenvalues largest first: the
  eigenvalues are `phi` (VBx's between-speaker variances) and the eigenvectors the rows of
  the transform. Only the first `lda_dimension` (128) directions are kept.

Every derived array is computed by the same NumPy/SciPy calls in the same order as pyannote,
so `transform` gives pyannote's `PLDA.__call__` bits.

The archives are read with `allow_pickle=False` (a model file is data, never code), and a
missing, ill-shaped or non-finite array is a PldaError whose one-line message names the file
and the array.

Loading by name (`speakerd.model.source.resolve_plda`, behind `serve --plda` and
`speakerd fetch-model --plda`): a Hugging Face repo id such as
`pyannote/speaker-diarization-community-1[@revision]` names the pipeline repo; its PLDA is the
two files under the repo's `plda/` folder, fetched as pyannote's
`PLDA.from_pretrained(repo, subfolder="plda")` fetches them (huggingface_hub's
`hf_hub_download(repo, "xvec_transform.npz", subfolder="plda", revision=...)` and the same
for `plda.npz`, with its cache, `HF_TOKEN` for the gated repo, `HF_HUB_OFFLINE` and
`HF_ENDPOINT`). Both land in one snapshot folder, `.../snapshots/<commit>/plda/`, which is
what `load_plda` takes. A local directory holding the two files is used as it is.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.linalg import eigh

#: The archive with the x-vector preprocessing (centring, length norms, LDA).
TRANSFORM_FILE = "xvec_transform.npz"
#: The archive with the PLDA model.
PLDA_FILE = "plda.npz"
#: Directions of the PLDA space VBx uses: pyannote's `PLDA(lda_dimension=128)` default, which
#: community-1 keeps (its LDA projects the 256-d ResNet embeddings to 128 dimensions).
LDA_DIMENSION = 128


class PldaError(ValueError):
    """A PLDA file that cannot be used; the message is one line naming the file."""


def _arrays(path: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named arrays of an .npz archive, without unpickling anything."""
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise PldaError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PldaError(f"{path}: not a NumPy .npz archive ({reason})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise PldaError(f"{path}: a single .npy array, not an .npz archive of {', '.join(names)}")
    with archive:
        missing = [name for name in names if name not in archive.files]
        if missing:
            raise PldaError(
                f"{path}: missing array {', '.join(repr(m) for m in missing)} "
                f"(has {', '.join(archive.files) or 'none'})"
            )
        arrays = {}
        for name in names:
            try:
                array = archive[name]
            except ValueError as error:  # an object array needs pickle
                raise PldaError(f"{path}: array {name!r} is not numeric ({error})") from None
            if array.dtype.kind not in "fiu":
                raise PldaError(f"{path}: array {name!r} has dtype {array.dtype}, expected floats")
            if not np.all(np.isfinite(array)):
                raise PldaError(f"{path}: array {name!r} has non-finite values")
            arrays[name] = array
    return arrays


def _expect_shape(path: Path, name: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
    if array.shape != shape:
        raise PldaError(f"{path}: array {name!r} has shape {array.shape}, expected {shape}")


@dataclass(frozen=True)
class Plda:
    """The x-vector transform and the PLDA basis (module docstring).

    mean1 [D], lda [D, L], mean2 [L]: xvec_transform.npz as stored; mu [L]: plda.npz's mean;
    basis [L, L]: rows are the generalised eigenvectors, largest eigenvalue first; eigenvalues
    [L]: those eigenvalues (between-speaker variances); lda_dimension: how many are used.
    """

    mean1: np.ndarray
    lda: np.ndarray
    mean2: np.ndarray
    mu: np.ndarray
    basis: np.ndarray
    eigenvalues: np.ndarray
    lda_dimension: int = LDA_DIMENSION

    @property
    def phi(self) -> np.ndarray:
        """[lda_dimension] between-speaker variances of the kept directions (`PLDA.phi`)."""
        return self.eigenvalues[: self.lda_dimension]

    @property
    def embedding_dimension(self) -> int:
        return int(self.lda.shape[0])

    def xvector(self, embeddings: np.ndarray) -> np.ndarray:
        """[n, D] embeddings -> [n, L] preprocessed x-vectors (centre, norm sqrt(D), LDA,
        centre, norm sqrt(L)), in the operation order of `vbx_setup`'s `xvec_tf`."""
        dim_in, dim_out = self.lda.shape
        centred = embeddings - self.mean1
        unit = centred / np.linalg.norm(centred, axis=1, ord=2)[:, np.newaxis]
        # projected as lda.T @ rows.T, then transposed back: the same BLAS call as pyannote's
        projected = self.lda.T.dot((np.sqrt(dim_in) * unit).T).T - self.mean2
        return np.sqrt(dim_out) * (projected / np.linalg.norm(projected, axis=1, ord=2)[:, np.newaxis])

    def transform(self, embeddings: np.ndarray) -> np.ndarray:
        """[n, D] raw embeddings -> [n, lda_dimension] PLDA features (`PLDA.__call__`).

        The full basis is applied and then truncated, as pyannote does, so the kept columns
        are the same bits as its."""
        return (self.xvector(embeddings) - self.mu).dot(self.basis.T)[:, : self.lda_dimension]


def plda_from_files(
    transform_npz: str | Path, plda_npz: str | Path, lda_dimension: int = LDA_DIMENSION
) -> Plda:
    """The PLDA of the two archives (pyannote's `PLDA(transform_npz, plda_npz, lda_dimension)`)."""
    transform_npz, plda_npz = Path(transform_npz), Path(plda_npz)
    x = _arrays(transform_npz, ("mean1", "mean2", "lda"))
    p = _arrays(plda_npz, ("mu", "tr", "psi"))
    lda = x["lda"]
    if lda.ndim != 2 or 0 in lda.shape:
        raise PldaError(f"{transform_npz}: array 'lda' has shape {lda.shape}, expected [D, L]")
    dim_in, dim_out = lda.shape
    _expect_shape(transform_npz, "mean1", x["mean1"], (dim_in,))
    _expect_shape(transform_npz, "mean2", x["mean2"], (dim_out,))
    _expect_shape(plda_npz, "mu", p["mu"], (dim_out,))
    _expect_shape(plda_npz, "tr", p["tr"], (dim_out, dim_out))
    _expect_shape(plda_npz, "psi", p["psi"], (dim_out,))
    if not np.all(p["psi"] > 0):
        raise PldaError(f"{plda_npz}: array 'psi' must be positive (between-speaker variances)")
    if not 1 <= lda_dimension <= dim_out:
        raise PldaError(f"{plda_npz}: lda_dimension {lda_dimension} outside [1, {dim_out}] (the PLDA's size)")

    tr, psi = p["tr"], p["psi"]
    try:
        within = np.linalg.inv(tr.T.dot(tr))
        between = np.linalg.inv((tr.T / psi).dot(tr))
        eigenvalues, eigenvectors = eigh(between, within)
    except np.linalg.LinAlgError as error:
        raise PldaError(
            f"{plda_npz}: array 'tr' does not give positive-definite covariances ({error})"
        ) from None
    return Plda(
        mean1=x["mean1"],
        lda=lda,
        mean2=x["mean2"],
        mu=p["mu"],
        basis=eigenvectors.T[::-1],
        eigenvalues=eigenvalues[::-1],
        lda_dimension=lda_dimension,
    )


def load_plda(directory: str | Path, lda_dimension: int = LDA_DIMENSION) -> Plda:
    """The PLDA in a local directory holding xvec_transform.npz and plda.npz (the hub's
    community-1 repo has them under `plda/`; the module docstring says how a repo name is
    resolved to that directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PldaError(
            f"{directory}: not a directory (expected one holding {TRANSFORM_FILE} and {PLDA_FILE})"
        )
    return plda_from_files(directory / TRANSFORM_FILE, directory / PLDA_FILE, lda_dimension)
