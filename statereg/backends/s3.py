"""s3:// and s3a:// through s3fs: Amazon S3 and S3-compatible stores (MinIO, Ceph, moto).

s3fs is imported only when an s3:// root is opened, so statereg works without it installed.

Data files are not built in memory and then handed to s3fs: a file being written is cut into
parts as it is written, each part filled once into one of a few reused buffers and uploaded
(a multipart upload) while the next is filled, `write_parts_in_flight` at once per file. A
load streams the byte runs it needs in `read_chunk` ranged GETs, `read_ahead` of them in
flight per file, into the destination tensors (verified as they arrive, by the reader): no
whole-file buffer on either side (docs/storage.md, "S3").
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import collections
import concurrent.futures
import contextlib
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from statereg.backends.base import (
    EXCLUSIVE_WRITE,
    IncompleteUpload,
    PositionedReads,
    StorageBackend,
)
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import HashingWriter, WrittenFile, checksum_of, new_hasher

# A conditional PUT racing another one on the same key may be answered 409
# ConditionalRequestConflict ("retry"); the retry then gets 412 if the other one won.
_CONFLICT_RETRIES = 5


def _s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError, or of the one s3fs chained as the cause."""
    for link in (exc, exc.__cause__):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
    return None


def _with_unsigned_payload(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with botocore told not to SHA-256 the bodies it sends, unless they say.

    botocore signs every body sent over plain http (an in-cluster MinIO or SeaweedFS) with
    SHA-256, on s3fs's one event-loop thread: about 0.6 of the 2.5 client CPU-s a 1 GB save
    took (profiled on SeaweedFS). Bodies still carry their CRC32 checksum header (S3 refuses a
    body that does not match it) and statereg verifies every item it loads against its own
    checksums; over https botocore already sends checksummed bodies unsigned. Setting
    `config_kwargs: {s3: {payload_signing_enabled: true}}` signs them again.
    """
    config = dict(options.get("config_kwargs") or {})
    s3_config = dict(config.get("s3") or {})
    s3_config.setdefault("payload_signing_enabled", False)
    return {**options, "config_kwargs": {**config, "s3": s3_config}}


class S3Backend(StorageBackend):
    """Checkpoints under an S3 prefix; each file is one PUT, or one multipart upload if large."""

    schemes = ("s3", "s3a")
    client_package = "s3fs"
    install_extra = "s3"
    # Listings are read fresh every time: another process (a second rank, an evaluator,
    # retention run elsewhere) may have changed the prefix since this one last looked.
    default_options = {"use_listings_cache": False}
    # The multipart part size ("chunksize", as s3fs calls it; S3 needs at least 5 MiB a part,
    # at most 10,000 parts: from part 1,000 on, every 1,000 parts double it). A file smaller
    # than one part is one PUT. Parts of 8 MiB kept 4 in flight per file fill a loopback
    # link from 2 cores while bounding a save's buffers to 5 parts per file written at once.
    upload_options = {"chunksize": 8 * 2**20}
    write_parts_in_flight = 4
    # What a save holds beyond the state: the part buffers of the 8 files the I/O policy
    # writes at once on an object store (engine/io_policy.py), plus a stated 64 MiB for the
    # client's own buffers and the save's bookkeeping.
    write_window = 8 * (write_parts_in_flight + 1) * upload_options["chunksize"] + 64 * 2**20
    # Loads: ranged GETs of this size, this many ahead per file being read: the memory a
    # load holds beyond its destination tensors is at most (read_ahead + 1) x read_chunk per
    # reader thread; `read_window` at the 8 readers the I/O policy gives an object store
    # (engine/io_policy.py).
    read_chunk = 8 * 2**20
    read_ahead = 4
    read_window = 8 * (read_ahead + 1) * read_chunk
    kind = StoreCapabilities("object-store", "network")
    # PUT with If-None-Match: * (S3 since August 2024; MinIO, moto): the store refuses the
    # write with 412 if the key exists, so of two racing writers exactly one wins.
    atomic_create = True

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        return super()._open_filesystem(url, _with_unsigned_payload(options))

    def _bucket_missing(self, not_found: FileNotFoundError) -> bool:
        # s3fs keeps botocore's ClientError as the cause, with S3's error code.
        return _s3_error_code(not_found) == "NoSuchBucket"

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self.full_path(path).partition("/")
        return bucket, key

    def _store_if_absent(self, path: str, data: bytes) -> WrittenFile:
        bucket, key = self._split(path)
        hasher = new_hasher()
        hasher.update(data)
        with self._storage_op(EXCLUSIVE_WRITE, path):
            for attempt in range(_CONFLICT_RETRIES):
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                    IfNoneMatch="*")
                    break
                except FileExistsError:
                    raise
                except Exception as exc:
                    code = _s3_error_code(exc)
                    if code == "PreconditionFailed":
                        raise FileExistsError(self.display(path)) from None
                    if code != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES - 1:
                        raise
                    time.sleep(0.05 * (attempt + 1))
            self.fs.invalidate_cache(self.full_path(path))
        return WrittenFile(path, len(data), checksum_of(hasher))

    def incomplete_uploads(self, path: str = "") -> list[IncompleteUpload]:
        bucket, key = self._split(path)
        prefix = f"{key}/" if key else ""
        found: list[IncompleteUpload] = []
        request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        with self._storage_op("list uploads", path):
            while True:
                page = self.fs.call_s3("list_multipart_uploads", **request)
                for upload in page.get("Uploads", []) or []:
                    initiated = upload.get("Initiated")
                    root_key = self.root.partition("/")[2]
                    relative = upload["Key"][len(root_key) + 1:] if root_key else upload["Key"]
                    found.append(IncompleteUpload(
                        relative, upload["UploadId"],
                        initiated.timestamp() if initiated is not None else None))
                if not page.get("IsTruncated"):
                    break
                request["KeyMarker"] = page.get("NextKeyMarker")
                request["UploadIdMarker"] = page.get("NextUploadIdMarker")
        return found

    def abort_upload(self, upload: IncompleteUpload) -> None:
        bucket, key = self._split(upload.path)
        with self._storage_op("abort upload", upload.path):
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                            UploadId=upload.upload_id)

    # -- streamed writes and reads ------------------------------------------------------

    def open_write(self, path: str, on_done: Callable[[WrittenFile], None] | None = None,
                   ) -> HashingWriter:
        """A stream for a new object: parts are uploaded while it is written (see the module
        docstring); on close the upload is completed (or the one PUT sent) and reported."""
        sink = _PartUploads(self, path, int(self.upload_options["chunksize"]),
                            self.write_parts_in_flight)
        return _AbortingWriter(path, sink, lambda _: sink.finish(), on_done)

    @contextlib.contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Iterator[IO[bytes]]:
        """A seekable stream over `ranges` of the object that fetches them in `read_chunk`
        ranged GETs, `read_ahead` in flight, holding no more than those (base: one GET per
        run, each held whole)."""
        with _StreamedRanges(self, path, ranges, size, self.read_chunk,
                             self.read_ahead) as stream:
            yield stream  # type: ignore[misc]

    def _submit(self, method: str, **kwargs: Any) -> concurrent.futures.Future:
        """Start one S3 call on s3fs's event loop, without a thread; its future."""
        return asyncio.run_coroutine_threadsafe(self.fs._call_s3(method, **kwargs),
                                                self.fs.loop)


class _AbortingWriter(HashingWriter):
    """A HashingWriter whose abort (the writer raised) also aborts the multipart upload."""

    def abort(self) -> None:
        if not self.closed:
            self._sink.abort()  # type: ignore[attr-defined]
        super().abort()


def _body_as_view(request: Any, **_: Any) -> None:
    """botocore's before-send hook for UploadPart: hand aiohttp a memoryview of the part's
    buffer (botocore accepts only bytes or bytearray bodies; aiohttp slices a bytearray body
    to its Content-Length, a copy of every part)."""
    if isinstance(request.body, bytearray):
        request.body = memoryview(request.body)


def _send_parts_as_views(client: Any) -> None:
    client.meta.events.register("before-send.s3.UploadPart", _body_as_view,
                                unique_id="statereg-part-body-view")


def _crc32_header(part: Any) -> dict[str, str]:
    """The checksum header of one part (CRC32, as botocore would send, computed by zlib with
    the GIL released): computed by the thread that filled the part, not on s3fs's one
    event-loop thread, which then only sends it."""
    return {"ChecksumCRC32": base64.b64encode(
        zlib.crc32(part).to_bytes(4, "big")).decode("ascii")}


# Parts numbered up to here are the configured size; each further thousand doubles it, so a
# file reaches S3's 10,000-part limit only beyond ~5 TB at the default size.
_PARTS_PER_SIZE = 1000


class _PartUploads:
    """The sink of one object's bytes: each part is filled once, into a reused buffer, and
    sent as it is (bytearray bodies: no copy before the client's socket writes) while the
    next is filled; at most `in_flight` parts are uploading. Every failure aborts the
    multipart upload and is raised as a StorageError naming the file."""

    def __init__(self, backend: S3Backend, path: str, part_size: int, in_flight: int) -> None:
        self.backend, self.path = backend, path
        self.bucket, self.key = backend._split(path)
        self.part_size, self.in_flight = part_size, max(1, in_flight)
        self.free: list[bytearray] = []
        self.buffer = bytearray(part_size)
        self.filled = 0
        self.upload_id: str | None = None
        self.pending: collections.deque[tuple[int, bytearray, concurrent.futures.Future]] = \
            collections.deque()
        self.parts: list[dict[str, Any]] = []

    def _size_of(self, number: int) -> int:
        return self.part_size << max(0, (number - 1) // _PARTS_PER_SIZE)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            room = len(self.buffer) - self.filled
            take = min(room, len(view))
            self.buffer[self.filled:self.filled + take] = view[:take]
            self.filled += take
            view = view[take:]
            if self.filled == len(self.buffer):
                self._send_part()
        return total

    def _send_part(self) -> None:
        """Upload the full buffer as the next part and take a free buffer for what follows."""
        with self.backend._storage_op("write", self.path):
            if self.upload_id is None:
                self.upload_id = self.backend.fs.call_s3(
                    "create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]
                _send_parts_as_views(self.backend.fs.s3)
            while len(self.pending) >= self.in_flight:
                self._collect()
        number = len(self.parts) + len(self.pending) + 1
        body = self.buffer if self.filled == len(self.buffer) else self.buffer[:self.filled]
        future = self.backend._submit("upload_part", Bucket=self.bucket, Key=self.key,
                                      UploadId=self.upload_id, PartNumber=number, Body=body,
                                      **_crc32_header(body))
        self.pending.append((number, self.buffer, future))
        size = self._size_of(number + 1)
        reuse = [b for b in self.free if len(b) == size]
        self.buffer = reuse[0] if reuse else bytearray(size)
        self.free = [b for b in self.free if b is not self.buffer]
        self.filled = 0

    def _collect(self) -> None:
        """Wait for the oldest part in flight; its buffer becomes free."""
        number, buffer, future = self.pending.popleft()
        etag = future.result()["ETag"]
        self.parts.append({"PartNumber": number, "ETag": etag})
        self.free.append(buffer)

    def finish(self) -> None:
        """Store the object: one PUT if it never filled a part, else the last part and the
        multipart completion. Returns once the store acknowledged it."""
        full = self.backend.full_path(self.path)
        try:
            with self.backend._storage_op("write", self.path):
                if self.upload_id is None:  # smaller than a part: s3fs's one PUT
                    self.backend.fs.pipe_file(full, bytes(self.buffer[:self.filled]),
                                              **self.backend.upload_options)
                else:
                    if self.filled:
                        self._send_part()
                    while self.pending:
                        self._collect()
                    self.backend.fs.call_s3(
                        "complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                        UploadId=self.upload_id, MultipartUpload={"Parts": self.parts})
        except BaseException:
            self.abort()
            raise
        finally:
            self.buffer, self.free = bytearray(), []
        self.backend.fs.invalidate_cache(full)

    def close(self) -> None:
        """Release the part buffers (HashingWriter closes its sink on abort)."""
        self.buffer, self.free = bytearray(), []

    def abort(self) -> None:
        """Drop the parts in flight and abort the multipart upload (best effort: what an
        abort cannot reach is an incomplete upload, which `statereg gc` aborts)."""
        for _, _, future in self.pending:
            future.cancel()
            with contextlib.suppress(BaseException):
                future.result()
        self.pending.clear()
        if self.upload_id is not None:
            upload, self.upload_id = self.upload_id, None
            with contextlib.suppress(Exception):
                self.backend.fs.call_s3("abort_multipart_upload", Bucket=self.bucket,
                                        Key=self.key, UploadId=upload)


class _StreamedRanges(PositionedReads):
    """A seekable view of `ranges` of an object, fetched in chunks of `chunk` bytes with
    `ahead` ranged GETs in flight in front of the position; a chunk is released once the
    position passes it. A read outside every range fetches just what it asks for. A chunk
    the store returns short (a truncated object) reads as the end of the file there."""

    def __init__(self, backend: S3Backend, path: str, ranges: Sequence[tuple[int, int]],
                 size: int | None, chunk: int, ahead: int) -> None:
        super().__init__(backend, path, size)
        self._s3 = backend
        self._chunks = [(at, min(at + chunk, end)) for start, end in sorted(ranges)
                        for at in range(start, end, chunk)]
        if size is not None:
            self._chunks = [(s, min(e, size)) for s, e in self._chunks if s < size]
        self._starts = [s for s, _ in self._chunks]
        self._ahead = max(1, ahead)
        self._fetching: dict[int, concurrent.futures.Future] = {}
        self._held = (0, 0, _Received([]))  # (start, index, pieces) of the chunk being read

    def _fetch(self, index: int) -> concurrent.futures.Future:
        """Start the GET of chunk `index` (headers and body, on s3fs's loop) unless it is."""
        found = self._fetching.get(index)
        if found is None:
            start, end = self._chunks[index]
            found = self._fetching[index] = asyncio.run_coroutine_threadsafe(
                _get_range(self._s3, self._path, start, end), self._s3.fs.loop)
        return found

    def _chunk_at(self, position: int) -> tuple[int, _Received] | None:
        """The chunk holding `position` (fetched, its GETs ahead started), or None outside
        every range."""
        index = bisect.bisect_right(self._starts, position) - 1
        if index < 0 or position >= self._chunks[index][1]:
            return None
        if len(self._held[2]) and self._held[1] == index:
            return self._held[0], self._held[2]
        for stale in [i for i in self._fetching if i < index]:
            self._fetching.pop(stale).cancel()
        for ahead in range(index, min(index + self._ahead, len(self._chunks))):
            self._fetch(ahead)
        future = self._fetching.pop(index)
        with self._s3._storage_op("read", self._path):
            data = future.result()
        self._held = (self._chunks[index][0], index, data)
        return self._chunks[index][0], data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not view:
            return 0
        found = self._chunk_at(self._pos)
        if found is None:  # outside the ranges: just the bytes asked for
            if self._size is not None and self._pos >= self._size:
                return 0
            data = _Received([self._s3.read_range(self._path, self._pos,
                                                  self._pos + len(view))])
            start = self._pos
        else:
            start, data = found
        got = data.copy_to(view, self._pos - start)
        self._pos += got
        return got

    def close(self) -> None:
        for future in self._fetching.values():
            future.cancel()
        self._fetching.clear()
        self._held = (0, 0, _Received([]))
        super().close()


class _Received:
    """The body of one ranged GET as the pieces aiohttp received it (no joined copy): the
    reader copies from them straight into its destination."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [p for p in pieces if p]
        self.starts, total = [], 0
        for piece in self.pieces:
            self.starts.append(total)
            total += len(piece)
        self.size = total

    def __len__(self) -> int:
        return self.size

    def copy_to(self, view: memoryview, at: int) -> int:
        """Copy bytes from offset `at` into `view`, as many as fit; how many."""
        done, index = 0, bisect.bisect_right(self.starts, at) - 1
        while done < len(view) and 0 <= index < len(self.pieces) and at < self.size:
            piece = self.pieces[index]
            offset = at - self.starts[index]
            take = min(len(view) - done, len(piece) - offset)
            view[done:done + take] = memoryview(piece)[offset:offset + take]
            done, at, index = done + take, at + take, index + 1
        return done



async def _get_range(backend: S3Backend, path: str, start: int, end: int) -> _Received:
    """Bytes [start, end) of the object, fewer if it ends sooner (none past its end)."""
    bucket, key = backend._split(path)
    try:
        response = await backend.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                             Range=f"bytes={start}-{end - 1}")
    except Exception as exc:
        if _s3_error_code(exc) == "InvalidRange" or "InvalidRange" in str(exc):
            return _Received([])  # the object ends before `start`: a truncated file reads short
        raise
    async with response["Body"] as body:
        # aiohttp's chunks as they arrived: body.read() would join them into one more copy.
        pieces = [piece async for piece, _ in body.raw_stream.content.iter_chunks()]
    got = _Received(pieces)
    if len(got) != int(response.get("ContentLength", len(got))):
        raise OSError(f"the store sent {len(got)} bytes of a "
                      f"{response['ContentLength']}-byte range {start}-{end - 1}")
    return got
