"""The client is thin: a pyannote environment can take it without the server's dependencies.

What is checked, each in a fresh interpreter so that nothing this test process imported
counts: importing every client module loads none of onnx, onnxruntime, CuPy or torch; the
client still works with those packages made unimportable (reading a reference case for
`verify` included); and the base install (no extras) requires none of them.
The layering itself (no client module imports a server layer) is import-linter's contract
in pyproject.toml, run by `make lint`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
#: Server-side packages the client must never load: the CPU engine's and the GPU engine's, and
#: SciPy and scikit-learn (speakerd.model.diarization's clustering and VBx's KMeans, server
#: extras).
#: (grpc_reflection is a server extra too, but `import grpc` itself loads it when it is
#: installed, so only the base-install test below can speak for it.)
SERVER_ONLY = ("onnx", "onnxruntime", "cupy", "cudnn", "torch", "huggingface_hub", "scipy", "sklearn")
CLIENT_MODULES = (
    "speakerd.client",
    "speakerd.client.client",
    "speakerd.client.cli",
    "speakerd.client.loadgen",
    "speakerd.client.verify",
)

#: Run first in the child: any import of a server-only package raises, as in an environment
#: where it is not installed.
BLOCKER = f"""
import importlib.abc, sys
BLOCKED = {SERVER_ONLY!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: server-only)")
        return None
sys.meta_path.insert(0, Blocker())
"""


def run_child(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_importing_the_client_loads_no_server_dependency() -> None:
    imports = "; ".join(f"import {name}" for name in CLIENT_MODULES)
    code = f"{imports}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(run_child(code)))
    offenders = sorted(name for name in loaded if name.split(".")[0] in SERVER_ONLY)
    assert not offenders, f"importing the client loaded {offenders}"
    server_layers = sorted(
        name
        for name in loaded
        if name.startswith(("speakerd.onnx", "speakerd.engine", "speakerd.reference", "speakerd.serving"))
    )
    assert not server_layers, f"importing the client loaded server layers {server_layers}"


def test_the_client_cli_and_verify_reader_work_without_server_packages(tmp_path: Path) -> None:
    """`verify` reads reference files with no onnx: a case file is read with them blocked."""
    fbank = np.zeros((1, 998, 80), np.float32)
    masks = np.ones((1, 3, 589), np.float32)
    output = np.full((3, 256), 0.5, np.float32)
    case = tmp_path / "first_b1.safetensors"
    metadata = {"speakerd": json.dumps({"case": "first_b1", "model_id": "test"})}
    save_file({"input/fbank": fbank, "input/masks": masks, "tensor/output": output}, str(case), metadata)
    code = BLOCKER + (
        "from speakerd.client import cli\n"
        "from speakerd.model.cases import load_case\n"
        f"case = load_case({str(case)!r})\n"
        "cli.build_parser()\n"
        "print(case.name, case.chunks, case.output.shape)\n"
    )
    assert run_child(code).split() == ["first_b1", "1", "(3,", "256)"]


def test_the_base_install_requires_no_server_package() -> None:
    """`pip install speakerd` is the client: the server's packages are extras only."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {
        requirement.split(">")[0].split("=")[0].split("<")[0].strip()
        for requirement in project["dependencies"]
    }
    server_distributions = {
        "onnx",
        "onnxruntime",
        "cupy-cuda12x",
        "cupy-cuda13x",
        "torch",
        "grpcio-reflection",
        "huggingface_hub",
        "scipy",
        "scikit-learn",
    }
    assert not base & server_distributions, f"base dependencies include {sorted(base & server_distributions)}"
    server = " ".join(project["optional-dependencies"]["server"])
    assert "onnxruntime" in server and "onnx>" in server, server
    assert "scikit-learn>" in server, f"VBx's KMeans needs scikit-learn in the server extra: {server}"


def test_no_install_of_speakerd_requires_torch() -> None:
    """pyannote's checkpoints are read with NumPy: neither the base install nor the server or
    GPU extras name torch (only `pyannote`, which is pyannote.audio's own requirement, does)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for name in ("server", "gpu", "gpu-cuda13"):
        requirements = project["dependencies"] + extras[name]
        assert not [r for r in requirements if r.lower().startswith(("torch", "pyannote"))], (
            name,
            requirements,
        )
    assert any(r.startswith("huggingface_hub") for r in extras["server"]), "--model org/name needs it"
