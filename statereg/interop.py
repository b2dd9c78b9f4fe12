"""What users call to move weights in and out of statereg.

- `export_hf`: a statereg checkpoint's model -> a Hugging Face safetensors directory;
- `load_model_from`: a Hugging Face directory or a plain DCP directory -> a live model;
- `detect_foreign` / `load_foreign` / `describe_foreign`: what `mgr.load(path)` and
  `statereg inspect` do with a directory that has no statereg manifest.

Foreign sources carry no manifest and no checksums: loads from them say "not verified".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend, url_scheme
from statereg.backends.stores import ReadableStore
from statereg.backends.verified import VerifiedReads
from statereg.dcp import METADATA_NAME
from statereg.engine.by_url import open_checkpoint, split_checkpoint_url
from statereg.engine.io_policy import io_policy
from statereg.engine.load import KeyReport, LoadResult, missing_as_damage, read_records
from statereg.engine.report import Progress, describe_rate, format_bytes, format_table
from statereg.engine.world import World, caught, raise_own
from statereg.errors import CheckpointMismatchError, CheckpointNotFoundError, SpecError
from statereg.formats.files import open_model_files
from statereg.formats.foreign import (
    DCPDirectory,
    check_component_names,
    prepare_optimizer,
)
from statereg.formats.hf import (
    INDEX_NAME,
    SUFFIX,
    SafetensorsDirectory,
    cast_metas,
    write_safetensors,
)
from statereg.formats.tensors import nbytes
from statereg.formats.torchfile import TorchFile
from statereg.schemas.spec import DEFAULT_MAX_SHARD_SIZE, PrefixSpec, parse_size
from statereg.state.factory import Adapter
from statereg.state.model import ModelAdapter
from statereg.state.optimizer import OptimizerAdapter

logger = logging.getLogger(__name__)

ForeignKind = Literal["hf", "dcp"]
FOREIGN_NOTE = "foreign, not verified (no statereg manifest: no sizes or checksums to check)"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

TensorSource = SafetensorsDirectory | DCPDirectory


def detect_foreign(backend: StorageBackend, name: str) -> ForeignKind | None:
    """'dcp' for a plain DCP directory, 'hf' for safetensors files, None otherwise."""
    entries = backend.list_dir(name)
    if METADATA_NAME in entries:
        return "dcp"
    if any(e.endswith(SUFFIX) or e == INDEX_NAME for e in entries):
        return "hf"
    return None


def open_foreign(backend: StorageBackend, name: str, kind: ForeignKind, prefix: str = "",
                 ) -> TensorSource:
    if kind == "hf":
        return SafetensorsDirectory(backend, name)
    return DCPDirectory(backend, name, prefix, io_policy(backend.capabilities).read_threads)


def prepare_model(source: TensorSource, adapter: ModelAdapter, strict: bool,
                  ) -> tuple[Callable[[], None], KeyReport]:
    """Check a model against a foreign source (floating dtypes are cast); nothing loads yet."""
    targets = adapter.load_targets(source.metas, {}, strict, cast=True)
    missing, unexpected = adapter.key_differences(source.metas, {})
    report = KeyReport(tuple(sorted(targets)), tuple(missing), tuple(unexpected))
    return (lambda: _load_with_progress(source, targets, adapter.name)), report


def _load_with_progress(source: TensorSource, targets: dict[str, torch.Tensor],
                        what: str) -> None:
    """Copy `targets` in from `source` under a progress bar: a safetensors directory file
    by file (each file is read once either way), a DCP directory in its one load."""
    if isinstance(source, SafetensorsDirectory):
        by_file: dict[str, list[str]] = {}
        for name in targets:
            by_file.setdefault(source.file_of[name], []).append(name)
        steps = list(by_file.values())
    else:
        steps = [list(targets)]
    total = sum(nbytes(source.metas[n]) for n in targets)
    with Progress(total, f"load {what}") as progress:
        for names in steps:
            source.load_into({n: targets[n] for n in names})
            progress.update(sum(nbytes(source.metas[n]) for n in names))


def _open_directory(path: str | os.PathLike[str], options: dict[str, Any] | None,
                    ) -> tuple[StorageBackend, str]:
    root, name = split_checkpoint_url(os.fspath(path))
    return open_backend(root, options), name


def load_model_from(path: str | os.PathLike[str], model: nn.Module, *,
                    prefix: PrefixSpec | dict[str, str] | None = None, strict: bool = True,
                    options: dict[str, Any] | None = None) -> KeyReport:
    """Load a Hugging Face safetensors directory (one file, or shards with an index) or a
    plain DCP directory into `model`, e.g. to start a fine-tune.

    `prefix` maps the model's keys to the source's names as a component's prefix rule does
    (`{"add": "model."}` reads `model.*` of a `dcp.save({"model": ...})`). Strict by default:
    a missing or unexpected key raises CheckpointMismatchError before anything changes;
    with strict=False the matching keys load and the report names the others.
    """
    backend, name = _open_directory(path, options)
    kind = detect_foreign(backend, name)
    if kind is None:
        raise CheckpointNotFoundError(
            f"{backend.display(name)} holds neither .safetensors files nor a DCP .metadata; "
            "a statereg checkpoint loads with CheckpointManager.load"
        )
    rule = PrefixSpec.model_validate(prefix) if isinstance(prefix, dict) else prefix
    source = open_foreign(backend, name, kind)
    apply, report = prepare_model(source, ModelAdapter("model", model, rule), strict)
    logger.info("loading %s into the model (%s, %d tensors)", backend.display(name),
                "safetensors" if kind == "hf" else "plain DCP", len(report.loaded))
    started = time.perf_counter()
    with torch.no_grad(), caught() as loading:
        apply()
    if loading.error is not None:  # DCP wraps a damaged item's error: raise statereg's own
        raise_own(loading.error, f"loading {backend.display(name)}", 0)
    logger.info("loaded %s: %s", backend.display(name), describe_rate(
        sum(nbytes(source.metas[n]) for n in report.loaded if n in source.metas),
        time.perf_counter() - started))
    logger.warning("loaded %s into the model: %s; %s", backend.display(name), report,
                   FOREIGN_NOTE)
    return report


def _foreign_components(kind: ForeignKind, declared: Mapping[str, str], include: list[str] | None,
                        exclude: list[str]) -> list[str]:
    """The components a foreign load fills: the user names them (HF: the model by default)."""
    if include is None and kind == "hf":
        include = [n for n, k in declared.items() if k == "model" and n not in exclude]
    if not include:
        raise SpecError(
            "load: a plain DCP checkpoint has no manifest saying what it holds; name the "
            "components to load, e.g. include=['model', 'optimizer'] (each reads the items "
            "under its name)"
        )
    chosen = [n for n in include if n not in exclude]
    for name in chosen:
        if name not in declared:
            raise SpecError(f"load: {name!r} is not a declared component; declared: "
                            f"{', '.join(declared)}")
        allowed = ("model",) if kind == "hf" else ("model", "optimizer")
        if declared[name] not in allowed:
            raise SpecError(
                f"load: component {name!r} is kind {declared[name]}; a "
                f"{'Hugging Face directory' if kind == 'hf' else 'plain DCP checkpoint'} "
                f"fills {' and '.join(allowed)} components only"
            )
    if kind == "hf" and len(chosen) != 1:
        raise SpecError(f"load: a Hugging Face directory holds one model; choose one of "
                        f"{chosen} with include=[...]")
    return chosen


def load_foreign(backend: StorageBackend, name: str, kind: ForeignKind,
                 declared: Mapping[str, str], adapters: dict[str, Adapter],
                 include: list[str] | None, exclude: list[str], world: World, strict: bool,
                 ) -> LoadResult:
    """Fill named components (`declared`: name -> kind) from a foreign directory, checking all
    of them before any loads."""
    names = _foreign_components(kind, declared, include, exclude)
    steps: list[Callable[[], None]] = []
    reports: dict[str, KeyReport] = {}

    def prepare_all() -> None:
        for comp in names:
            adapter = adapters.get(comp)
            if adapter is None:
                raise SpecError(f"component {comp!r} has no object to load into; pass it to "
                                "CheckpointManager(...) or leave it out of include")
            source = open_foreign(backend, name, kind, "" if kind == "hf" else f"{comp}.")
            if isinstance(source, DCPDirectory):
                check_component_names(source, comp)
            if declared[comp] == "optimizer" and isinstance(source, DCPDirectory):
                assert isinstance(adapter, OptimizerAdapter)  # built for the declared kind
                steps.append(prepare_optimizer(source, comp, adapter))
            else:
                assert isinstance(adapter, ModelAdapter)  # foreign sources fill models only
                apply, reports[comp] = prepare_model(source, adapter, strict)
                steps.append(apply)

    with caught() as checking:
        prepare_all()
    world.agree(checking.error, f"checking {backend.display(name)}")

    def apply_all() -> None:
        with torch.no_grad():
            for step in steps:
                step()

    with caught() as loading:
        apply_all()
    world.agree(loading.error, f"loading {backend.display(name)}")
    for comp, report in reports.items():
        logger.warning("loaded %s into %r: %s; %s", backend.display(name), comp, report,
                       FOREIGN_NOTE)
    return LoadResult(step=0, tokens_seen=None, extra={}, path=backend.display(name),
                      components=tuple(names), verified=False, keys=reports)


def describe_foreign(url: str, options: dict[str, Any] | None = None) -> str:
    """What `statereg inspect` prints for a directory without a statereg manifest."""
    backend, name = _open_directory(url, options)
    kind = detect_foreign(backend, name)
    if kind is None:
        raise CheckpointNotFoundError(
            f"{backend.display(name)} has no manifest.json, no DCP .metadata and no "
            ".safetensors files: it is not a checkpoint (an interrupted save leaves no "
            "manifest; `statereg ls` lists the committed checkpoints)"
        )
    lines = [f"checkpoint:  {url}"]
    if kind == "dcp":
        source = DCPDirectory(backend, name)
        lines.append(f"format:      plain torch.distributed.checkpoint; {FOREIGN_NOTE}")
        rows = [("name", "tensors", "bytes", "other items")]
        rows += [(top, str(n), format_bytes(size), str(other))
                 for top, (n, size, other) in source.top_level.items()]
        lines += ["", *format_table(rows), "",
                  "load with: mgr.load(URL, include=[<names above>]) or "
                  "statereg.load_model_from(URL, model, prefix={'add': '<name>.'})"]
    else:
        hf = SafetensorsDirectory(backend, name)
        total = sum(nbytes(m) for m in hf.metas.values())
        files = sorted(set(hf.file_of.values()))
        lines += [f"format:      Hugging Face safetensors; {FOREIGN_NOTE}",
                  f"total:       {len(hf.metas)} tensors in {len(files)} files, "
                  f"{format_bytes(total)}",
                  "load with: mgr.load(URL) or statereg.load_model_from(URL, model)"]
    return "\n".join(lines)


def _read_config(config: str | os.PathLike[str]) -> bytes:
    """The bytes of the config.json to copy beside the weights; SpecError naming the path if
    it is missing, a directory or unreadable (checked before any shard is written)."""
    path = Path(config)
    try:
        if path.is_dir() or (path.exists() and not path.is_file()):  # a FIFO would block
            raise SpecError(f"--config {os.fspath(config)!r} is not a regular file; give the "
                            "model's config.json file itself")
        return path.read_bytes()
    except OSError as exc:
        raise SpecError(f"--config {os.fspath(config)!r} cannot be read "
                        f"({exc.strerror or exc}); give the model's config.json") from None


@dataclass(frozen=True)
class Export:
    """What export_hf wrote."""

    path: str
    files: tuple[str, ...]
    tensors: int
    bytes: int


def export_hf(url: str, out_dir: str | os.PathLike[str], *, component: str | None = None,
              dtype: str | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
              config: str | os.PathLike[str] | None = None,
              options: dict[str, Any] | None = None) -> Export:
    """Write a checkpoint's model as a Hugging Face safetensors directory at `out_dir`.

    Reads any of statereg's model formats, a file at a time (never the whole model at once
    for dcp and safetensors). `dtype` ('bf16', 'fp16', 'fp32') converts floating tensors;
    `config` is a config.json copied beside the weights. Tied weights are written once, under
    the first name (transformers ties them again when it loads).
    """
    if dtype is not None and dtype not in DTYPES:
        raise SpecError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    limit = parse_size(max_shard_size)
    # Read before anything is written: a bad --config must not leave shards behind.
    config_bytes = None if config is None else _read_config(config)
    backend, ckpt = open_checkpoint(url, options)
    models = [n for n, c in ckpt.manifest.components.items() if c.kind == "model"]
    if component is None and len(models) != 1:
        raise SpecError(f"{url} has {len(models) or 'no'} model components ({models}); "
                        "choose one with --component")
    name = component or models[0]
    record = ckpt.manifest.components.get(name)
    if record is None or record.kind != "model" or record.sharing == "per_group":
        raise SpecError(f"{url}: {name!r} is not a model component saved once (models: "
                        f"{models})")
    data_dir = ckpt.manifest.data_dir(ckpt.name)  # under writer-<token>/ where it has one
    directory = f"{data_dir}/{name}"
    # Every byte exported is checked against the manifest as it is read, as a load does.
    verified: ReadableStore = VerifiedReads(backend, read_records(ckpt.manifest.without_writer(),
                                                        data_dir, [name]))
    source: TensorSource | TorchFile
    if record.format == "dcp":
        dcp_source = DCPDirectory(verified, directory,
                                  thread_count=io_policy(backend.capabilities).read_threads)
        dcp_source.reader.verify_unchecked(dcp_source.reader.read_metadata())
        source = dcp_source
    else:
        source = open_model_files(verified, directory, record.format)
    if not source.metas:
        raise CheckpointMismatchError(f"{url}: component {name!r} holds no tensors")
    out = os.fspath(out_dir)
    same = url_scheme(out) == url_scheme(url)
    target = open_backend(out, options if same else None)
    written: list[str] = []
    cast = DTYPES[dtype] if dtype else None

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        with caught() as reading:
            tensors = source.read(names)
        error = missing_as_damage(reading.error, f"reading {backend.display(directory)}")
        if error is not None:  # DCP wraps a damaged item's CorruptCheckpointError: unwrap it
            raise_own(error, f"reading {backend.display(directory)}", 0)
        return tensors

    size = sum(nbytes(m) for m in cast_metas(source.metas, cast).values())
    logger.info("exporting %r of %s to %s: %d tensors, %s", name, backend.display(ckpt.name),
                target.display(), len(source.metas), format_bytes(size))
    started = time.perf_counter()
    with Progress(sum(nbytes(m) for m in source.metas.values()), f"export {name}") as progress:

        def read_counted(names: list[str]) -> dict[str, torch.Tensor]:
            tensors = read(names)
            progress.update(sum(nbytes(source.metas[n]) for n in names))
            return tensors

        write_safetensors(target, "", source.metas, read_counted, limit,
                          lambda f: written.append(f.path), writes=True, dtype=cast)
    if config_bytes is not None:
        target.write_bytes("config.json", config_bytes)
        written.append("config.json")
    logger.info("exported %s: %d files, %s", target.display(), len(written),
                describe_rate(size, time.perf_counter() - started))
    return Export(target.display(), tuple(sorted(written)), len(source.metas), size)
