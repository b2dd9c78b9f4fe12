"""Compatibility alias: the item codec moved to `statereg.dcp.codec`.

`statereg.backends.codec.extension_registry` was the documented way to hand statereg's
float-aware decoder to a plain DCP reader, so the name keeps working. Storage imports no
torch, so this module resolves names lazily: importing it loads nothing, and the first name
asked of it imports `statereg.dcp.codec` (and torch). It is the one import from
`statereg.backends` up into `statereg.dcp`, declared in pyproject.toml's import-linter
contracts (`ignore_imports`). New code imports `statereg.dcp.codec`.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from statereg.dcp import codec

    return getattr(codec, name)
