"""The `statereg` command: plan, schema, ls, inspect, verify, cp, export-hf, gc; `--json` on
the ones that report (their documents: statereg/schemas/cli.py).

One module per job: `parser` (the arguments and `main`, the console script's entry point),
`plan` (plan and schema), `reading` (ls, inspect, verify), `maintenance` (cp, export-hf, gc)
and `common` (what they share). `plan` and `schema` never import torch, so they answer in
well under a second.
"""

from statereg.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
