"""Write simkv/cli/vllm_serve_flags.json: every flag of `vllm serve`, as the installed vLLM's
parser defines it (a development aid, run in the vLLM oracle's environment:
`/tmp/vllm-oracle-venv/bin/python scripts/vllm_serve_flags.py`). simkv/cli/vllm_serve.py reads
the file to take a serve command apart; tests/cli/test_vllm_serve.py checks that each flag in it
is sorted into what simkv models, what it ignores and what it refuses."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "simkv" / "cli" / "vllm_serve_flags.json"


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

    parser = make_arg_parser(FlexibleArgumentParser())
    flags = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        every = sorted(o for o, a in parser._option_string_actions.items() if a is action)
        negative = sorted(getattr(action, "negative_option_strings", ())
                          or [o for o in every if o.startswith("--no-")])
        flags[action.dest] = {"options": [o for o in every if o not in negative], "negative": negative,
                              "nargs": _arity(action), "default": _default(action.default)}
    text = json.dumps({"vllm_version": vllm.__version__, "flags": flags}, indent=1, sort_keys=True) + "\n"
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(OUT)
    print(f"{OUT}: {len(flags)} flags of vLLM {vllm.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
