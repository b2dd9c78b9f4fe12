"""Copy a committed checkpoint between any two roots, optionally changing its compression.

Every source file is checked against the manifest's size and checksum as it is copied, in
bounded blocks (a damaged file stops the copy before the destination is committed); DCP
items that are rewritten are checked by their digests as they are read. Tensor records
written without zip CRC-32s (a memory root's: `IOPolicy.record_crcs`) get them on the
way to a store that keeps them, so a drained checkpoint holds what a save there writes. The
destination manifest is written last, so an interrupted or refused copy leaves no committed
checkpoint behind (`statereg gc` removes its leftovers).
"""

from __future__ import annotations

import logging
import pickle
import posixpath
import time
from collections import defaultdict
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import (
    FileRecorder,
    WrittenFile,
    missing,
    verify_stream,
)
from statereg.backends.local import LocalBackend
from statereg.backends.verified import VerifiedReads
from statereg.dcp import METADATA_NAME
from statereg.dcp.codec import CompressionSettings
from statereg.dcp.metadata import ITEM_CHECKSUMS, gc_paused, item_checksums, load_dcp_metadata
from statereg.dcp.quiet import single_process_dcp
from statereg.dcp.reader import BackendReader, SafeLoadPlanner, load_in_place
from statereg.dcp.torchsave import RecordError, add_crcs
from statereg.dcp.writer import BackendWriter, HashingTee
from statereg.engine.checkpoints import Committed, read_latest, read_manifest_at, step_of
from statereg.engine.claims import claim_checkpoint, claim_scope
from statereg.engine.io_policy import io_policy
from statereg.engine.load import read_records
from statereg.engine.publish import commit
from statereg.engine.report import Progress, describe_rate, format_bytes
from statereg.engine.save_steps import FileCodec, file_codec
from statereg.engine.world import caught, raise_own
from statereg.errors import CorruptCheckpointError
from statereg.schemas.manifest import FileRecord, Manifest

logger = logging.getLogger(__name__)

# "keep": copy the bytes as they are; None: write uncompressed; settings: (re)compress.
Recompress = CompressionSettings | None | Literal["keep"]


class _LoadEverything(SafeLoadPlanner):
    """Loads every item of a DCP directory into a flat dict keyed as stored (weights-only)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        assert metadata is not None and not state_dict
        for key, stored in metadata.state_dict_metadata.items():
            state_dict[key] = (torch.empty(stored.size, dtype=stored.properties.dtype)
                               if isinstance(stored, TensorStorageMetadata) else stored)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _is_dcp_file(path: str) -> bool:
    name = posixpath.basename(path)
    return name == METADATA_NAME or name.endswith(".distcp")


def _copy_checked(src: StorageBackend, src_dir: str, record: FileRecord, dst: StorageBackend,
                  name: str, recorder: FileRecorder) -> None:
    """Stream one file from `src` (under `src_dir`) to `dst` (under `name`), checking its size
    and checksum on the way; the destination file is dropped, not reported, if they differ."""
    path = f"{src_dir}/{record.path}"
    where = src.display(path)
    writer = dst.open_write(f"{name}/{record.path}", recorder.add)
    try:
        with src.open_blocks(path) as stream:
            verify_stream(where, record, stream, writer.write)
    except FileNotFoundError:
        writer.abort()
        raise missing(where, record) from None
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _copy_adding_crcs(src: StorageBackend, src_dir: str, directory: str,
                      records: dict[str, FileRecord], dst: StorageBackend, name: str,
                      recorder: FileRecorder, progress: Progress) -> None:
    """Copy DCP directory `directory` of the checkpoint in `src_dir` (to `name` in `dst`),
    whose tensor records have no CRC-32s, each record given its CRC-32s on the way
    (`add_crcs`; same offsets and lengths) and checked against its digest as it is read;
    other items are copied as they are, checked the same way (an item without a digest is
    refused). `.metadata` is written again with the new records' digests; a data file no
    item names is copied as it is, checked whole."""
    folder = f"{src_dir}/{directory}"
    meta_path = f"{folder}/{METADATA_NAME}"
    metadata = load_dcp_metadata(VerifiedReads(src, records).read_bytes(meta_path),
                                 src.display(meta_path))
    expected = item_checksums(metadata)
    listed = {path.removeprefix(f"{folder}/"): record for path, record in records.items()
              if posixpath.dirname(path) == folder and _is_dcp_file(path)}
    files: dict[str, list[Any]] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        files[info.relative_path].append((info.offset, info.length, index))
    record: FileRecord | None
    for relative, record in listed.items():
        if relative not in files and relative != METADATA_NAME:
            _copy_checked(src, src_dir, record, dst, name, recorder)
            progress.update(record.size)
    digests: dict[Any, int] = {}
    for relative, items in sorted(files.items()):
        path = f"{folder}/{relative}"
        where = src.display(path)
        record = listed.get(relative)
        if record is None:
            raise CorruptCheckpointError(
                f"{src.display(meta_path)} refers to {where}, which the manifest does not list "
                "in its directory; refusing to copy it: the checkpoint is damaged or altered")
        writer = dst.open_write(f"{name}/{record.path}", recorder.add)
        try:
            with src.open_read(path, record.size) as stream:
                position = 0
                for offset, length, index in sorted(items, key=lambda item: item[0]):
                    if offset != position:
                        raise CorruptCheckpointError(
                            f"{where}: its items do not follow one another from its start "
                            f"(one at byte {offset}, {position} expected)")
                    out = HashingTee(writer)
                    read = xxhash.xxh3_64()
                    tensor = metadata.state_dict_metadata.get(index.fqn)
                    if isinstance(tensor, TensorStorageMetadata):
                        try:
                            add_crcs(stream, offset, length, out, read)
                        except RecordError as exc:
                            raise CorruptCheckpointError(f"{where}: item {index.fqn!r} is not "
                                                         f"a torch.save record ({exc})") from None
                    else:
                        stream.seek(offset)
                        data = stream.read(length)
                        read.update(data)
                        out.write(data)
                    if read.intdigest() != expected.get(index):
                        raise CorruptCheckpointError(
                            f"{where}: item {index.fqn!r} does not match its digest; the "
                            "checkpoint is damaged: copy an earlier one")
                    digests[index] = out.hasher.intdigest()
                    position += length
                    progress.update(length)
                if position != record.size:
                    raise CorruptCheckpointError(
                        f"{where}: its items end at byte {position}, the file at {record.size}")
        except BaseException:
            writer.abort()
            raise
        writer.close()
    setattr(metadata, ITEM_CHECKSUMS, digests)
    with dst.open_write(f"{name}/{directory}/{METADATA_NAME}", recorder.add) as meta_out, \
            gc_paused():
        pickle.dump(metadata, meta_out)


def _rewrite_dcp(src: StorageBackend, src_dir: str, records: dict[str, FileRecord],
                 dst: StorageBackend, dst_dir: str, compression: CompressionSettings | None,
                 recorder: FileRecorder) -> None:
    """Load every item of one DCP directory, each checked as it is read, and write it again
    with `compression`."""
    state: dict[str, Any] = {}
    reader = BackendReader(VerifiedReads(src, records), src_dir,
                           io_policy(src.capabilities).read_threads, records=records)
    reader.verify_unchecked(reader.read_metadata())
    with caught() as reading:
        load_in_place(state, reader, _LoadEverything())
    if reading.error is not None:  # DCP wraps failures in a BaseException; raise the real one
        raise_own(reading.error, f"reading {src.display(src_dir)}", 0)
    # The destination's I/O policy for these files (its read_cache, where it has one).
    io = io_policy(dst.capabilities, compressed=compression is not None,
                   read_cache=dst.read_cache if isinstance(dst, LocalBackend) else "auto")
    writer = BackendWriter(dst, dst_dir, recorder, thread_count=2, compression=compression,
                           crcs=io.record_crcs, around_cache=io.write_around_cache)
    with single_process_dcp():
        dcp.save(state, storage_writer=writer, no_dist=True)


def copy_checkpoint(src: StorageBackend, name: str, dst: StorageBackend,
                    recompress: Recompress = "keep") -> Manifest:
    """Copy checkpoint `name` from `src` to the same name under `dst`; returns the new manifest.

    With `recompress` other than "keep", or when the source is an incremental checkpoint,
    each DCP directory is read whole into memory and written again (the copy is
    self-contained: it never writes into another checkpoint directory of `dst`); other files
    are copied byte for byte.
    """
    stored = read_manifest_at(src, name)
    started = time.perf_counter()
    logger.info("copying %s to %s: %d files, %s", src.display(name), dst.display(name),
                len(stored.files), format_bytes(stored.total_bytes))
    # A source saved under a writer token (a store without exclusive creates) is read from
    # its writer directory and copied without one: the copy is claimed like any save.
    src_dir, source = stored.data_dir(name), Committed(name, stored.without_writer())
    with claim_scope():
        # Claimed like a save: refuses a committed or in-progress step, clears leftovers of
        # an interrupted copy, and commit() below releases it.
        claim = claim_checkpoint(dst, name, purpose="copy")
        records = source.manifest.files
        dcp_dirs: set[str] = set()
        crc_dirs: set[str] = set()
        settings: dict[str, CompressionSettings | None] = {}
        if recompress != "keep" or source.manifest.references:
            # An incremental checkpoint's DCP metadata points at files of earlier
            # checkpoints ('../../step_N/...'). Copied as they are, those files would land
            # in the destination's step_N, which may be a committed checkpoint of its own:
            # so the copy is made self-contained instead, every item rewritten into its own
            # directory (with the source's codec when "keep"), and it has no references.
            dcp_dirs = {posixpath.dirname(r.path) for r in records
                        if posixpath.basename(r.path) == METADATA_NAME}
            settings = {d: (_source_settings(source.manifest, d) if recompress == "keep"
                            else recompress) for d in dcp_dirs}
        elif not io_policy(src.capabilities).record_crcs and \
                io_policy(dst.capabilities).record_crcs:
            # Uncompressed tensor records without CRC-32s (compressed ones keep them).
            crc_dirs = {posixpath.dirname(r.path) for r in records
                        if posixpath.basename(r.path) == METADATA_NAME} - {
                posixpath.dirname(r.path) for r in records
                if r.path.endswith(".distcp") and r.codec != "none"}
        recorder = FileRecorder()
        codecs: dict[str, FileCodec] = {r.path: r.codec for r in records}
        every_file = read_records(source.manifest, src_dir, source.manifest.components)
        with Progress(source.manifest.total_bytes, f"copy {name}") as progress:
            for record in records:
                if posixpath.dirname(record.path) in dcp_dirs | crc_dirs and _is_dcp_file(
                        record.path):
                    continue
                _copy_checked(src, src_dir, record, dst, name, recorder)
                progress.update(record.size)
            for directory in sorted(crc_dirs):
                _copy_adding_crcs(src, src_dir, directory, every_file, dst, name, recorder,
                                  progress)
            for directory in sorted(dcp_dirs):
                _rewrite_dcp(src, f"{src_dir}/{directory}", every_file, dst,
                             f"{name}/{directory}", settings[directory], recorder)
                for written in recorder.files():
                    if written.path.startswith(f"{name}/{directory}/"):
                        codecs[written.path.removeprefix(f"{name}/")] = file_codec(
                            written.path, settings[directory])
        manifest = _retarget(source.manifest, name, recorder.files(), codecs)
        latest = read_latest(dst)
        newer = latest is None or (step_of(latest) or -1) < manifest.step
        commit(dst, name, manifest, claim, move_latest=newer)
        logger.info("copied %s: every checksum verified; %s", dst.display(name),
                    describe_rate(manifest.total_bytes, time.perf_counter() - started))
        return manifest


def _source_settings(manifest: Manifest, directory: str) -> CompressionSettings | None:
    """The codec the source's DCP directory was written with, to rewrite it the same way."""
    codecs = {r.codec for r in manifest.files
              if r.path.startswith(f"{directory}/") and r.path.endswith(".distcp")}
    if not codecs or codecs == {"none"}:
        return None
    declared = manifest.spec.get("storage", {}).get("compression") or {}
    level = declared.get("level", 3) if isinstance(declared, dict) else 3
    return CompressionSettings(level=level if isinstance(level, int) else 3,
                               float_aware="zstd+planes" in codecs)


def _retarget(manifest: Manifest, name: str, written: list[WrittenFile],
              codecs: dict[str, FileCodec]) -> Manifest:
    """The source manifest with the files as written at the destination (self-contained:
    a copy never references files of another checkpoint)."""
    files = []
    for item in written:
        path = item.path.removeprefix(f"{name}/")
        files.append(FileRecord(path=path, size=item.size, checksum=item.checksum,
                                codec=codecs.get(path, "none")))
    data = manifest.model_dump(mode="json")
    data["files"] = [f.model_dump(mode="json") for f in files]
    data["references"] = []
    for comp_name, comp in data["components"].items():
        mine = [f for f in files if f.path.startswith(f"{comp_name}/")]
        comp.update(files=[f.path for f in mine], bytes=sum(f.size for f in mine))
    return Manifest.model_validate(data)
