"""Helpers shared by the reliability tests: child processes, exact comparisons, rewriting a
checkpoint's manifest to match damaged or hostile files (as an attacker with write access
would)."""

from __future__ import annotations

import json
import signal
from typing import Any

import torch
from child_processes import forkserver_context

import statereg
from statereg.backends.checksum import checksum_of, new_hasher
from statereg.backends.registry import open_backend


def forkserver() -> Any:
    """A multiprocessing context whose children fork from a server that imported torch,
    statereg and the crash driver once (tests/child_processes.py)."""
    return forkserver_context()


def run_child(target: Any, *args: Any, timeout: float = 120) -> int:
    """Run target(*args) in a forked child; returns its exit code (-9 after SIGKILL)."""
    process = forkserver().Process(target=target, args=args)
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise AssertionError(f"child {target.__name__}{args!r} did not finish in {timeout} s")
    return process.exitcode


KILLED = -signal.SIGKILL


def assert_identical(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal structure and values; tensors bit-exact (dtype, shape, bytes)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        if expected.numel():  # bytes, so NaN payloads, -0.0 and inf all count
            a = actual.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
            e = expected.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
            assert a.view(torch.uint8).equal(e.view(torch.uint8)), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}")
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def rewrite_manifest(url: str, options: dict[str, Any], changed: dict[str, bytes | None]) -> None:
    """Replace files of the checkpoint at `url` (None: delete) and rewrite manifest.json and
    manifest.sum to match, so checksums cannot tell: only the safe readers stand in the way."""
    root, _, name = url.rstrip("/").rpartition("/")
    backend = open_backend(root, options)
    manifest = json.loads(backend.read_bytes(f"{name}/manifest.json"))
    for path, data in changed.items():
        if data is None:
            backend.remove_file(f"{name}/{path}")
            manifest["files"] = [f for f in manifest["files"] if f["path"] != path]
            for comp in manifest["components"].values():
                comp["files"] = [p for p in comp["files"] if p != path]
            continue
        backend.write_bytes(f"{name}/{path}", data)
        hasher = new_hasher()
        hasher.update(data)
        records = [f for f in manifest["files"] if f["path"] == path]
        if not records:
            records = [{"path": path}]
            manifest["files"].append(records[0])
        records[0].update(size=len(data), checksum=checksum_of(hasher))
    write_manifest(backend, name, json.dumps(manifest, indent=1, sort_keys=True).encode())


def write_manifest(backend: Any, name: str, data: bytes) -> None:
    """Store manifest bytes with a manifest.sum that matches them."""
    hasher = new_hasher()
    hasher.update(data)
    backend.write_bytes(f"{name}/manifest.sum", f"{checksum_of(hasher)}\n".encode())
    backend.write_bytes(f"{name}/manifest.json", data)


def committed_names(root: str, options: dict[str, Any]) -> list[str]:
    from statereg.engine.checkpoints import list_committed

    return [c.name for c in list_committed(open_backend(root, options))]


__all__ = ["KILLED", "assert_identical", "committed_names", "forkserver", "rewrite_manifest",
           "run_child", "statereg", "write_manifest"]
