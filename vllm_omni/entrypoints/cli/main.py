"""Console scripts `vllm` and `vllm-omni`.

`vllm-omni serve MODEL [flags]` and `vllm serve MODEL --omni [flags]` start the
diffusion server; `vllm-omni random-lora --out DIR` writes a random LoRA adapter for
the tiny model. A `vllm` command without `--omni` belongs to vLLM: it is handed
to a real vLLM when one is installed; without one, `vllm --version` and
`vllm [serve] --help` answer for vllm-omni, and anything else is refused with one
line (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from vllm_omni import __version__

EXIT_USAGE = 2
VLLM_ALIASES = ("vllm", "vllm.exe")


def build_parser(prog: str = "vllm-omni") -> argparse.ArgumentParser:
    """The top-level parser with the `serve` subcommand."""
    from vllm_omni.entrypoints.cli.help import OmniArgumentParser
    from vllm_omni.entrypoints.cli.random_lora import add_random_lora_arguments
    from vllm_omni.entrypoints.cli.serve_args import add_serve_arguments

    parser = OmniArgumentParser(
        prog=prog,
        description="vllm-omni: diffusion serving with step-wise continuous batching (Qwen-Image).",
    )
    parser.add_argument("--version", "-v", action="version", version=f"vllm-omni {__version__}")
    parser.add_argument("--omni", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    omni = " --omni" if prog in VLLM_ALIASES else ""
    serve = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible images server.",
        description="Start the OpenAI-compatible images server (POST /v1/images/generations).",
        usage=f"%(prog)s [MODEL]{omni} [options]",
    )
    add_serve_arguments(serve)
    random_lora = subparsers.add_parser(
        "random-lora",
        help="Write a random LoRA adapter for a (tiny) model, to try LoRA serving (docs/lora.md).",
        description="Write a random LoRA adapter for a (tiny) model, to try LoRA serving (docs/lora.md).",
    )
    add_random_lora_arguments(random_lora)
    return parser


def run_real_vllm(argv: list[str]) -> int:
    """Hand a non-`--omni` `vllm` command to a real vLLM, or refuse in one line (exit 2)."""
    # NOTE: our package is `vllm_omni`; `vllm` is only found when real vLLM is installed.
    if importlib.util.find_spec("vllm") is None:
        print(
            "vllm: real vLLM is not installed; this `vllm` (from vllm-omni) only runs "
            "`vllm serve MODEL --omni` (or use `vllm-omni serve MODEL`).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    vllm_cli = importlib.import_module("vllm.entrypoints.cli.main")
    sys.argv = ["vllm", *argv]
    result = vllm_cli.main()
    return result if isinstance(result, int) else 0


def _is_help_or_version(argv: list[str]) -> bool:
    """`--version`, `--help`, or `serve ... --help[=TOPIC]`: questions vllm-omni can answer itself."""
    if argv in (["--version"], ["-v"], ["--help"], ["-h"], []):
        return True
    asks_help = any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)
    return bool(argv) and argv[0] == "serve" and asks_help


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Entry point of both console scripts; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0] or "vllm-omni")
    if prog in VLLM_ALIASES and "--omni" not in argv:
        real_vllm = importlib.util.find_spec("vllm") is not None
        if real_vllm or not _is_help_or_version(argv):
            return run_real_vllm(argv)
        if argv in (["--version"], ["-v"]):
            print(f"vllm-omni {__version__} (real vLLM is not installed)")
            return 0
    if prog not in VLLM_ALIASES:
        prog = "vllm-omni"
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # answered by the subcommand's parser: its usage line and its flags' suggestion
        parser.subcommand(args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "random-lora":
        from vllm_omni.entrypoints.cli.random_lora import cmd_random_lora

        return cmd_random_lora(args)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from vllm_omni.entrypoints.cli.serve import cmd_serve

    return cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
