"""Write simkv/cli/vllm_serve_flags.json and vllm_bench_flags.json: every flag of `vllm serve`
and of `vllm bench serve`, as the installed vLLM's parsers define them (a development aid, run
in the vLLM oracle's environment: `/tmp/vllm-oracle-venv/bin/python scripts/vllm_serve_flags.py`).
simkv/cli/vllm_serve.py and vllm_bench.py read the files to take such commands apart;
tests/replay/test_vllm_serve.py and test_vllm_bench_command.py check that each flag in them is
sorted into what simkv models, what it ignores and what it refuses."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "simkv" / "cli"


def _arity(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "0"
    if action.nargs in (None, 1):
        return "1"
    return str(action.nargs)  # "+", "?"


def _default(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else None


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()  # (the parser's defaults ask for a device type)
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm.benchmarks.serve import add_cli_args as add_bench_args

    bench = FlexibleArgumentParser()
    add_bench_args(bench)
    for parser, name in ((make_arg_parser(FlexibleArgumentParser()), "vllm_serve_flags.json"),
                         (bench, "vllm_bench_flags.json")):
        _write(parser, OUT / name, vllm.__version__)


def _write(parser, path: Path, version: str) -> None:
    flags = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        every = sorted(o for o, a in parser._option_string_actions.items() if a is action)
        negative = sorted(getattr(action, "negative_option_strings", ())
                          or ([o for o in every if o.startswith("--no-")]
                              if isinstance(action, argparse.BooleanOptionalAction) else []))
        flags[action.dest] = {"options": [o for o in every if o not in negative], "negative": negative,
                              "nargs": _arity(action), "default": _default(action.default)}
    text = json.dumps({"vllm_version": version, "flags": flags}, indent=1, sort_keys=True) + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(f"{path}: {len(flags)} flags of vLLM {version}", file=sys.stderr)


if __name__ == "__main__":
    main()
