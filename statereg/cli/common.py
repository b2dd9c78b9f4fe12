"""What the `statereg` commands share: storage options from --spec/--options, the argument
types of a checkpoint and of verify's target, the refusal of a missing local path, and the
printing of one --json document."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from statereg.errors import CheckpointNotFoundError, SpecError


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Storage options from --spec (its storage.options) and/or --options JSON."""
    options: dict[str, Any] = {}
    if args.spec:
        from statereg.declaration import load_spec

        options.update(load_spec(args.spec).storage.options)
    options.update(_json_options(args.options, "--options"))
    return options


def _json_options(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(given, dict):
        raise SpecError(f"{flag} must be a JSON object, e.g. '{{\"anon\": true}}'")
    return given


def _checkpoint_url(text: str) -> str:
    """A checkpoint argument: a local path made absolute, so that its last segment names the
    checkpoint directory ('.' inside one works); a URL as given. One that names no directory
    ('/', 's3://': it would read manifest.json from the current directory) or a store's top
    ('shm://run7') is refused, as `split_checkpoint_url` refuses it."""
    from statereg.engine.by_url import split_checkpoint_url

    url = text if "://" in text else os.path.abspath(text)
    try:
        split_checkpoint_url(url)
    except CheckpointNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url


def _verify_target(text: str) -> str:
    """verify's argument: a checkpoint or a root (a store's top, `s3://bucket`, is a root);
    one that names no directory at all ('/', 's3://') is refused as `_checkpoint_url` does."""
    from statereg.engine.by_url import split_checkpoint_url

    url = text if "://" in text else os.path.abspath(text)
    try:
        split_checkpoint_url(url)
    except CheckpointNotFoundError as exc:
        last = url.rstrip("/").rpartition("/")[2]
        if last in ("", ".", "..") or last.endswith(":"):
            raise argparse.ArgumentTypeError(str(exc)) from None
    return url


def _refuse_missing_local(url: str) -> None:
    """A local checkpoint path that does not exist is a typo or a deleted checkpoint: say
    that, not that a save was interrupted (which a directory without a manifest means)."""
    if "://" in url or os.path.lexists(url):
        return
    parent = os.path.dirname(url.rstrip("/"))
    where = (f"`statereg ls {parent}` lists the checkpoints there" if os.path.isdir(parent)
             else f"its folder {parent} does not exist either")
    raise CheckpointNotFoundError(f"{url} does not exist: check the path; {where}")


def _print_json(document: Any) -> None:
    """One --json document (a model of statereg/schemas/cli.py) on stdout."""
    print(document.model_dump_json(indent=2))
