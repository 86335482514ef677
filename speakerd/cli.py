"""`python -m speakerd COMMAND`: one entry point, each command in the module that owns it.

Commands are imported lazily so that `serve` on a CPU machine never imports CuPy. None
needs torch: `convert` and `--model` read pyannote's checkpoints with NumPy.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module with `configure(parser)` and `run(args) -> int`, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("speakerd.serving.server.command", "run the gRPC server (GPU when present, else CPU)"),
    "warm": (
        "speakerd.serving.server.warm",
        "build and check what serve builds with the same flags (filling the caches), then exit",
    ),
    "embed": ("speakerd.tools.embed", "embed an .npz of fbank or waveform chunks offline"),
    "make-model": ("speakerd.model.synthetic", "write the deterministic synthetic default model"),
    "make-segmentation-model": (
        "speakerd.model.segmentation.synthetic",
        "write the deterministic synthetic segmentation model",
    ),
    "make-references": ("speakerd.reference.references", "write ONNX Runtime CPU reference cases"),
    "convert": ("speakerd.tools.convert", "convert pyannote's pytorch_model.bin to safetensors"),
    "fetch-model": (
        "speakerd.tools.fetch_model",
        "download and convert --model (--segmentation-model, --plda) into the caches serve reads",
    ),
    "bench": ("speakerd.tools.bench", "benchmark the engine's plans, print JSON lines"),
    "bench-segmentation": (
        "speakerd.tools.bench_segmentation",
        "time the NumPy segmentation forward on a long recording",
    ),
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, except where there is none to show (None, False):
    there the help line says what happens without the flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speakerd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        command = sub.add_parser(name, help=help_line, description=help_line)
        command.set_defaults(_module=module)
        # configure lazily only for the chosen command, see main()
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        command = argparse.ArgumentParser(
            prog=f"speakerd {argv[0]}",
            description=COMMANDS[argv[0]][1],
            formatter_class=DefaultsHelpFormatter,
        )
        module.configure(command)
        return int(module.run(command.parse_args(argv[1:])) or 0)
    parser.parse_args(argv)  # prints usage / errors for unknown commands
    return 2
