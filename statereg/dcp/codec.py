"""The item codec, this module's one job: one DCP item's bytes to its stored bytes and back.

Everything here encodes one item on save (`EncodingStream`, `encode_zstd_parts`,
`encode_planes`) or decodes it, bounded, on load (`decode`, `decode_into`, `frame_stream`),
for the two stream transforms `.metadata` can name; `FloatPlanes` and `extension_registry()`
hand the same decoders to plain DCP readers. It is one file past 700 lines because the float
planes' encoder and decoder share their layout (header, plane order, nibble coding) and
change together (a new layout is a new descriptor version): splitting them would put one
format's two halves in two files.

Each DCP item (one tensor chunk, or one pickled object) is compressed on its own through DCP's
stream-transform hooks, so DCP's offsets, metadata and readers keep working:

- `stream.zstd/1` is DCP's own descriptor: a standard zstd frame that plain
  `torch.distributed.checkpoint.load` decodes without statereg.
- `statereg.planes/2` (float-aware, tensors of 64 KiB and more) works per block of 1Mi
  elements: byte k of every element goes to plane k, with the sign bit moved out of
  bfloat16/float32 exponents so one plane holds exactly the exponents (ZipNN's observation:
  exponents are highly skewed, mantissas near random). Exponents become 4-bit codes, two to a
  byte, before zstd; other planes are one zstd frame each, or stored raw when zstd cannot
  shrink them. torch.save's framing around the tensor is stored as it is.
  `statereg.planes/1` (whole planes, statereg 0.1) is still decoded.

Decoding is bounded: a frame never inflates past the size DCP's metadata gives for its item,
and every `statereg.planes` item carries an xxh3 digest of its original bytes.
"""

from __future__ import annotations

import io
import os
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch
import xxhash
import zstandard

from statereg.dcp.torch_private import (
    EXTENSIONS_AVAILABLE,
    ExtensionRegistry,
    StreamTransformExtension,
)
from statereg.errors import CorruptCheckpointError, StateregError
from statereg.process_state import process_wide

ZSTD_DESCRIPTOR = "stream.zstd/1"
PLANES_NAME = "statereg.planes"
PLANES_DESCRIPTOR = f"{PLANES_NAME}/2"
# Older layouts this version still reads.
PLANES_READABLE = {f"{PLANES_NAME}/1", PLANES_DESCRIPTOR}

# Float dtypes worth splitting: element size, and whether rotating the sign bit to the bottom
# leaves exactly the exponent in the top byte (8-bit exponents: bfloat16, float32).
_FLOAT_LAYOUT: dict[torch.dtype, tuple[int, bool]] = {
    torch.bfloat16: (2, True),
    torch.float16: (2, False),
    torch.float32: (4, True),
    torch.float64: (8, False),
}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_LITTLE_ENDIAN = sys.byteorder == "little"

# magic, element size, rotated, elements per block, prefix, body and suffix lengths, xxh3_64
# of the raw bytes; then the prefix; per block, each plane's (mode, length) and the planes;
# then the suffix.
_HEADER = struct.Struct("<4sBBIQQQQ")
_PLANE = struct.Struct("<BI")
_MAGIC = b"SRP2"
_BLOCK_ELEMS = 1 << 20
# Elements split per pass: a float32 pass (512 KiB) and its planes stay in a 1 MiB L2 cache.
_SUB_ELEMS = 1 << 17
# The first layout (statereg.planes/1): whole planes, the sign rotated through every byte.
_HEADER_V1 = struct.Struct("<4sBBQQ")
_PLANE_V1 = struct.Struct("<BQ")
_MAGIC_V1 = b"SRP1"
_RAW, _ZSTD, _NIBBLES = 0, 1, 2
# Exponents: the 15 most common consecutive values become 4-bit codes (0: look in the escape
# list), two to a byte, before zstd. Huffman codes whole bytes, so coding exponent pairs
# loses less to rounding code lengths than coding single exponents (~0.15 bit each here).
_NIBBLE_WINDOW = np.ones(15, dtype=np.int64)
_NIBBLE_HEADER = struct.Struct("<BI")  # lowest exponent of the window, escape count
_MAX_ESCAPES = 1 / 32
# A plane is stored raw unless zstd shrinks a sample of it by at least this factor.
_WORTH_IT = 0.995
_PROBE_BYTES = 32 * 1024
# Writes at least this long are kept as views instead of copied (a tensor's own bytes).
_KEEP_VIEW = 64 * 1024
# Smaller float tensors get one plain zstd frame: splitting them costs more than it saves.
MIN_PLANES_BYTES = _KEEP_VIEW
# The decoded bytes a FrameStream keeps from a frame's start (a record's header is ~1 KiB).
_KEPT_HEAD = 1 << 16


@dataclass(frozen=True)
class CompressionSettings:
    """How items are compressed: zstd `level` for generic bytes, `threads` per item."""

    level: int = 3
    threads: int = 0
    float_aware: bool = True


_local = threading.local()
# Encoding is CPU-bound: more encoders than cores only contend (with uploads, with the job).
_CODEC_SLOTS = threading.BoundedSemaphore(os.cpu_count() or 1)
process_wide(__name__, "_local", "each thread keeps its zstd compressors and plane buffers "
             "(a ZstdCompressor is not thread-safe, and costly to make)")
process_wide(__name__, "_CODEC_SLOTS", "encoders at once in the process, over every save: no "
             "more than the cores; a semaphore in use", kept=True)


def _compressor(key: tuple[Any, ...], make: Callable[[], zstandard.ZstdCompressor],
                ) -> zstandard.ZstdCompressor:
    """One compressor per thread and setting (a ZstdCompressor is not thread-safe)."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _generic(settings: CompressionSettings) -> zstandard.ZstdCompressor:
    def make() -> zstandard.ZstdCompressor:
        return zstandard.ZstdCompressor(level=settings.level, threads=settings.threads,
                                        write_checksum=True, write_content_size=True)

    return _compressor(("generic", settings.level, settings.threads), make)


def _plane(settings: CompressionSettings) -> zstandard.ZstdCompressor:
    # Planes are order-0 sources: a tiny match table leaves nearly all bytes to zstd's entropy
    # coder, which lands within 1% of the byte entropy at ~0.6 GB/s (level 19 gets no further).
    def make() -> zstandard.ZstdCompressor:
        params = zstandard.ZstdCompressionParameters.from_level(
            1, hash_log=6, min_match=7, threads=settings.threads, write_content_size=True)
        return zstandard.ZstdCompressor(compression_params=params)

    return _compressor(("plane", settings.threads), make)


def float_layout(dtype: torch.dtype | None) -> tuple[int, bool] | None:
    """(element size, rotate) for dtypes the float-aware mode splits into planes, else None."""
    return _FLOAT_LAYOUT.get(dtype) if dtype is not None else None


class _Scratch:
    """Per-thread buffers for one block (reused: fresh pages cost ~0.27 s/GiB here): a plane
    per byte of an element, the exponents, their codes, a spare byte plane, a mask, and
    16-bit words for the rotation and the pairing (one word longer: `_high_bytes` reads one
    byte past the last word)."""

    def __init__(self, elem_size: int) -> None:
        def plane() -> np.ndarray:
            return np.empty(_BLOCK_ELEMS + 2, dtype=np.uint8)  # + 2: an odd count pads a pair

        self.planes = [plane() for _ in range(elem_size)]
        self.exponents, self.codes, self.spare = plane(), plane(), plane()
        self.mask = np.empty(_BLOCK_ELEMS, dtype=bool)
        self.high = np.empty(_SUB_ELEMS, dtype=np.uint16)
        self.shifted = np.empty(_SUB_ELEMS, dtype=np.uint16)
        self.rotated = np.empty(_SUB_ELEMS + 1, dtype=np.uint16)
        self.paired = np.empty(_BLOCK_ELEMS // 2 + 2, dtype=np.uint16)


def _high_bytes(words: np.ndarray) -> np.ndarray:
    """The high bytes of all but the last 16-bit word, for numpy to cast to bytes.

    On little-endian hosts that is the buffer read as 16-bit words from its second byte:
    their low bytes are the high bytes wanted, and the narrowing cast runs at SIMD speed where
    a strided byte view copies one byte at a time (callers leave the spare last word). Other
    hosts shift.
    """
    if not _LITTLE_ENDIAN:
        return np.right_shift(words[:-1], 8)
    return np.ndarray((len(words) - 1,), dtype=np.uint16, buffer=words, offset=1, strides=(2,))


def _byte_sources(body: memoryview, elem_size: int) -> list[np.ndarray]:
    """Per byte k of an element, little-endian words whose low byte is that byte.

    Word k is the body read as unsigned words from byte k (unaligned past 0), so casting it
    to bytes yields plane k with numpy's SIMD narrowing cast, which a strided column copy of
    one byte per element does not get (0.2 ms against 0.45 ms a plane of 1Mi bytes). Words
    past the first stop one element short (the last would read past the body); the caller
    takes that element's bytes from the columns.
    """
    dtype = np.dtype(f"<u{elem_size}")

    def source(k: int) -> np.ndarray:
        length = len(body) // elem_size - (k > 0)
        if length <= 0:
            return np.empty(0, dtype=dtype)
        return np.ndarray((length,), dtype=dtype, buffer=body, offset=k, strides=(elem_size,))

    return [source(k) for k in range(elem_size)]


def _scratch(elem_size: int) -> _Scratch:
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    if elem_size not in cache:
        cache[elem_size] = _Scratch(elem_size)
    return cache[elem_size]


def encode_planes(body: memoryview, elem_size: int, rotate: bool,
                  settings: CompressionSettings, write: Callable[[Any], Any],
                  prefix: bytes = b"", suffix: bytes = b"") -> None:
    """Write the float-aware encoding of `prefix + body + suffix` through `write`.

    `body` holds the floats (`elem_size` bytes each); `prefix` and `suffix` (torch.save's
    zip records around them) are stored raw. `write` must consume each chunk before it
    returns: plane chunks are views of per-thread buffers reused for the next block.
    """
    body = body.cast("B") if body.ndim != 1 or body.format != "B" else body
    aligned = len(body) - len(body) % elem_size
    if aligned != len(body):
        suffix = bytes(body[aligned:]) + suffix
        body = body[:aligned]
    digest = xxhash.xxh3_64()
    for part in (prefix, body, suffix):
        digest.update(part)
    write(_HEADER.pack(_MAGIC, elem_size, int(rotate), _BLOCK_ELEMS, len(prefix), len(body),
                       len(suffix), digest.intdigest()))
    write(prefix)
    columns = np.frombuffer(body, dtype=np.uint8).reshape(-1, elem_size)
    sources = _byte_sources(body, elem_size)
    scratch = _scratch(elem_size)
    chosen: dict[int, zstandard.ZstdCompressor | None] = {}  # per plane, from the first block
    for start in range(0, len(columns), _BLOCK_ELEMS):
        count = min(_BLOCK_ELEMS, len(columns) - start)
        views = [plane[:count] for plane in scratch.planes]
        exponents = scratch.exponents[:count] if rotate else None
        for sub in range(0, count, _SUB_ELEMS):
            _split(columns, sources, start + sub, min(_SUB_ELEMS, count - sub),
                   [view[sub:] for view in views],
                   exponents[sub:] if exponents is not None else None, scratch)
        if exponents is not None:
            views[-1] = exponents
        coded: list[tuple[int, Any]] = []
        for k, view in enumerate(views):
            if view is exponents:
                packed = _nibble_exponents(view, settings, scratch)
                if packed is not None:
                    coded.append((_NIBBLES, packed))
                    continue
            if k not in chosen:
                # numpy's stubs give ndarray __buffer__ only on 3.12+:
                chosen[k] = _best_compressor(memoryview(view), settings)  # type: ignore[arg-type]
            compressor = chosen[k]
            # numpy's stubs give ndarray __buffer__ only on 3.12+:
            frame = compressor.compress(view) if compressor is not None else None  # type: ignore[arg-type]
            if frame is not None and len(frame) < count * _WORTH_IT:
                coded.append((_ZSTD, frame))
            else:
                # numpy's stubs give ndarray __buffer__ only on 3.12+:
                coded.append((_RAW, memoryview(view)))  # type: ignore[arg-type]
        write(b"".join(_PLANE.pack(mode, len(chunk)) for mode, chunk in coded))
        for _, chunk in coded:
            write(chunk)
    write(suffix)


def _split(columns: np.ndarray, sources: list[np.ndarray], first: int, count: int,
           planes: list[np.ndarray], exponents: np.ndarray | None, scratch: _Scratch) -> None:
    """Byte k of elements `first` .. `first + count` into `planes[k][:count]`.

    With `exponents`, the top two bytes are rotated left by one bit as one 16-bit word, so the
    sign moves below the mantissa's top bits and the top byte is exactly the exponent: that
    goes to `exponents`, the low byte to the second-to-last plane.
    """
    split = len(planes) - 2 if exponents is not None else len(planes)
    end = first + count
    for k in range(split):
        readable = min(end, len(sources[k])) - first
        np.copyto(planes[k][:readable], sources[k][first:first + readable], casting="unsafe")
        if readable < count:  # the body's last element: words past the first stop short
            planes[k][readable] = columns[-1, k]
    if exponents is None:
        return
    if split == 0:
        high = sources[0][first:end]
    else:
        high = scratch.high[:count]
        readable = min(end, len(sources[split])) - first
        np.copyto(high[:readable], sources[split][first:first + readable], casting="unsafe")
        if readable < count:
            high[readable] = int(columns[-1, split]) | int(columns[-1, split + 1]) << 8
    rotated, shifted = scratch.rotated[:count + 1], scratch.shifted[:count]
    # numpy has SIMD loops for adds but not for left shifts: `x + x` stands for `x << 1`.
    np.add(high, high, out=rotated[:count])
    np.right_shift(high, 15, out=shifted)
    np.bitwise_or(rotated[:count], shifted, out=rotated[:count])
    np.copyto(planes[split][:count], rotated[:count], casting="unsafe")
    np.copyto(exponents[:count], _high_bytes(rotated), casting="unsafe")


def _nibble_exponents(exponents: np.ndarray, settings: CompressionSettings,
                      scratch: _Scratch) -> bytes | None:
    """Exponents as 4-bit codes, two to a byte, zstd'd; None if too many fall outside."""
    count = len(exponents)
    sample = exponents[::max(1, count // 16384)]
    base = int(np.convolve(np.bincount(sample, minlength=256), _NIBBLE_WINDOW, "valid").argmax())
    codes, spare, outside = scratch.codes[:count + 1], scratch.spare[:count], scratch.mask[:count]
    np.subtract(exponents, np.uint8((base - 1) % 256), out=codes[:count])  # window -> 1..15
    np.subtract(codes[:count], np.uint8(1), out=spare)
    np.greater(spare, np.uint8(14), out=outside)
    escape_count = int(np.count_nonzero(outside))
    if escape_count > count * _MAX_ESCAPES:
        return None
    escapes = b""
    if escape_count:
        at = np.flatnonzero(outside)
        escapes = exponents[at].tobytes()
        codes[at] = 0
    codes[count] = 0  # pads an odd count
    half = (count + 1) // 2
    # Two codes to a byte, first code high. Read as a little-endian 16-bit word, a pair is
    # first + 256 * second; times 0x1001 (mod 2**16) its high byte is 16 * first + second.
    paired, packed = scratch.paired[:half + 1], spare[:half]
    np.multiply(codes[:2 * half].view("<u2"), np.uint16(0x1001), out=paired[:half])
    np.copyto(packed, _high_bytes(paired), casting="unsafe")
    # numpy's stubs give ndarray __buffer__ only on 3.12+:
    return b"".join([_NIBBLE_HEADER.pack(base, escape_count), _plane(settings).compress(packed),  # type: ignore[arg-type]
                     escapes])


def _damaged(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: float-aware item is damaged ({what})")


def _unnibble_exponents(chunk: memoryview, count: int, source: str) -> np.ndarray:
    """Invert `_nibble_exponents`."""
    if len(chunk) < _NIBBLE_HEADER.size:
        raise _damaged(source, "exponent plane is truncated")
    base, escape_count = _NIBBLE_HEADER.unpack_from(chunk)
    if escape_count > count or _NIBBLE_HEADER.size + escape_count > len(chunk):
        raise _damaged(source, "exponent escapes overrun the plane")
    half = (count + 1) // 2
    packed = np.frombuffer(decode_zstd(chunk[_NIBBLE_HEADER.size:len(chunk) - escape_count],
                                       half, source), dtype=np.uint8)
    if len(packed) != half:
        raise _damaged(source, f"exponent plane holds {2 * len(packed)} codes, expected {count}")
    codes = np.empty(2 * half, dtype=np.uint8)
    np.right_shift(packed, 4, out=codes[0::2])
    np.bitwise_and(packed, 15, out=codes[1::2])
    codes = codes[:count]
    escaped = (codes == 0).nonzero()[0]
    if len(escaped) != escape_count:
        raise _damaged(source, "exponent escapes do not match their codes")
    np.add(codes, np.uint8((base - 1) % 256), out=codes)
    codes[escaped] = np.frombuffer(chunk[len(chunk) - escape_count:], dtype=np.uint8)
    return codes


def _best_compressor(plane: memoryview, settings: CompressionSettings,
                     ) -> zstandard.ZstdCompressor | None:
    """The setting that shrinks a sample of the plane most, or None if neither pays.

    Random-looking planes (mantissas) are stored raw; skewed ones (exponents) suit the
    entropy setting; planes with repeats (moments early in training) suit zstd's matching.
    """
    sample = plane[:_PROBE_BYTES]
    if not len(sample):
        return None
    candidates = [_plane(settings), _generic(settings)]
    sizes = [len(c.compress(sample)) for c in candidates]
    best = min(range(len(sizes)), key=sizes.__getitem__)
    return candidates[best] if sizes[best] < len(sample) * _WORTH_IT else None


def decode_zstd(frame: bytes | bytearray | memoryview, bound: int, source: str) -> bytes:
    """Decompress one zstd frame that must not inflate past `bound` bytes."""
    try:
        declared = zstandard.frame_content_size(frame)
        if declared > bound:
            raise CorruptCheckpointError(
                f"{source}: a compressed item declares {declared} bytes, more than the "
                f"{bound} its metadata allows; refusing to inflate it"
            )
        if declared < 0:
            # No size in the header (a streamed frame): inflate at most one byte past the bound.
            with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
                out = reader.read(bound + 1)
        else:
            out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=bound)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(
            f"{source}: a compressed item cannot be decoded ({exc}); the file is damaged"
        ) from None
    if len(out) > bound:
        raise CorruptCheckpointError(f"{source}: a compressed item inflates past {bound} bytes")
    return out


class FrameStream(io.RawIOBase):
    """The decoded bytes of one zstd frame (`stream.zstd/1`), read forward as
    `torchsave.read_into` walks a record, so the payload lands in its tensor without a
    buffer of the whole record. The first `_KEPT_HEAD` bytes are kept, so the walk may seek
    back into them; any other step back is refused (the walk then gives up and the caller
    decodes the item whole). `finish` reads to the frame's end, which checks its checksum."""

    def __init__(self, frame: bytes, size: int, source: str) -> None:
        super().__init__()
        self.size, self._source = size, source
        self._reader = zstandard.ZstdDecompressor().stream_reader(frame,
                                                                  read_across_frames=False)
        self._head = bytearray()
        self._pos = self._decoded = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        pos += {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if pos < len(self._head) or pos == self._decoded:
            self._pos = pos
        elif pos > self._decoded:
            self._pos = self._decoded
            while self._pos < pos and self.read(min(pos - self._pos, 1 << 20)):
                pass
        else:
            raise io.UnsupportedOperation("a zstd frame is read forward")
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._pos < len(self._head):
            got = min(len(view), len(self._head) - self._pos)
            view[:got] = self._head[self._pos:self._pos + got]
            self._pos += got
            return got
        if self._pos != self._decoded:
            raise io.UnsupportedOperation("a zstd frame is read forward")
        view, got = view[:self.size - self._pos], 0
        while got < len(view):
            more = self._pull(view[got:])
            if not more:
                break
            got += more
        if self._decoded < _KEPT_HEAD:
            self._head += view[:min(got, _KEPT_HEAD - self._decoded)]
        self._decoded += got
        self._pos += got
        return got

    def _pull(self, view: memoryview) -> int:
        try:
            return self._reader.readinto(view) or 0
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{self._source}: a compressed item cannot be "
                                         f"decoded ({exc}); the file is damaged") from None

    def finish(self) -> None:
        """Read to the frame's end, which checks its checksum: it must end at its size."""
        self.seek(self.size)
        if self._pos != self.size or self._pull(memoryview(bytearray(1))):
            raise CorruptCheckpointError(f"{self._source}: a compressed item does not decode "
                                         f"to the {self.size} bytes its frame declares")


def frame_stream(frame: bytes, bound: int, source: str) -> FrameStream | None:
    """A `FrameStream` over a frame that declares its size (statereg's and DCP's do), at
    most `bound`; None otherwise (the caller decodes it whole, with `decode`)."""
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        return None
    return FrameStream(frame, size, source) if 0 <= size <= bound else None


def decode_planes(blob: bytes | bytearray | memoryview, bound: int, source: str,
                  ) -> bytearray:
    """Invert `encode_planes`, checking every length against the blob and `bound`."""

    blob = memoryview(blob)
    if len(blob) >= 4 and bytes(blob[:4]) == _MAGIC_V1:
        return _decode_planes_v1(blob, bound, source)
    header = _planes_header(blob, source)
    prefix_len, body_len, suffix_len = header[3:6]
    total = prefix_len + body_len + suffix_len
    if total > bound:
        raise CorruptCheckpointError(
            f"{source}: a compressed item declares {total} bytes, more than the {bound} its "
            "metadata allows; refusing to inflate it"
        )
    out = bytearray(total)
    view = memoryview(out)
    prefix, suffix = _decode_planes_v2(blob, header, view[prefix_len:prefix_len + body_len],
                                       source)
    view[:prefix_len] = prefix
    view[prefix_len + body_len:] = suffix
    return out


def decode_into(descriptors: Sequence[str], blob: bytes, into: memoryview, source: str,
                frames: Callable[[bytes, bytes], bool]) -> bool:
    """Decode one item straight into `into` (a tensor's own bytes), if it can be.

    It can when the item is one `statereg.planes/2` encoding whose body is exactly `into`'s
    size, and `frames(prefix, suffix)` says the stored bytes around the body make the plain
    record of that tensor. That skips `decode`'s buffer of the whole record (fresh pages) and
    the copy out of it. Returns False, with nothing written, where it cannot; raises
    CorruptCheckpointError as `decode` does, `into` then holding part of the item.
    """
    if list(descriptors) != [PLANES_DESCRIPTOR]:
        return False
    view = memoryview(blob)
    if len(view) < 4 or bytes(view[:4]) != _MAGIC:
        return False
    header = _planes_header(view, source)
    prefix_len, body_len, suffix_len = header[3:6]
    if body_len != len(into) or _HEADER.size + prefix_len + suffix_len > len(view):
        return False
    prefix = bytes(view[_HEADER.size:_HEADER.size + prefix_len])
    suffix = bytes(view[len(view) - suffix_len:])
    if not frames(prefix, suffix):
        return False
    _decode_planes_v2(view, header, into, source)
    return True


def _planes_header(blob: memoryview, source: str) -> tuple[int, ...]:
    """The checked header of a `statereg.planes/2` item, less its magic."""
    if len(blob) < _HEADER.size:
        raise _damaged(source, "shorter than its header")
    magic, *header = _HEADER.unpack_from(blob)
    elem_size, rotate, block_elems, _, body_len = header[:5]
    if (magic != _MAGIC or elem_size not in _UINT or rotate > 1 or block_elems < 1
            or body_len % elem_size):
        raise _damaged(source, "bad header")
    return tuple(header)


def _decode_planes_v2(blob: memoryview, header: tuple[int, ...], body: memoryview,
                      source: str) -> tuple[memoryview, memoryview]:
    """Decode the blocks of a `statereg.planes/2` item into `body` (its size, from
    `header`), hashing each block while it is in cache; returns the stored prefix and
    suffix, once the digest of the three together matched."""
    elem_size, rotate, block_elems, prefix_len, _, suffix_len, digest = header
    pos = _HEADER.size

    def take(length: int, what: str) -> memoryview:
        nonlocal pos
        chunk = blob[pos:pos + length]
        if len(chunk) != length:
            raise _damaged(source, f"{what} is truncated")
        pos += length
        return chunk

    prefix = take(prefix_len, "prefix")
    hasher = xxhash.xxh3_64(prefix)
    columns = np.frombuffer(body, dtype=np.uint8).reshape(-1, elem_size)
    index = struct.Struct("<" + "BI" * elem_size)
    for start in range(0, len(columns), block_elems):
        block = columns[start:start + block_elems]
        count = len(block)
        fields = index.unpack(take(index.size, "plane index"))
        planes = []
        for k in range(elem_size):
            mode, length = fields[2 * k], fields[2 * k + 1]
            chunk = take(length, f"plane {k}")
            plane: memoryview | bytes | np.ndarray
            if mode == _RAW:
                plane = chunk
            elif mode == _ZSTD:
                plane = decode_zstd(chunk, count, source)
            elif mode == _NIBBLES and rotate and k == elem_size - 1:
                plane = _unnibble_exponents(chunk, count, source)
            else:
                raise _damaged(source, f"plane {k} has unknown mode {mode}")
            if len(plane) != count:
                raise _damaged(source, f"plane {k} holds {len(plane)} bytes, expected {count}")
            planes.append(np.frombuffer(plane, dtype=np.uint8))
        if rotate:  # `(x & 1) * 128` is `x << 7` without numpy's slow byte shift
            top, nxt = planes[-1], planes[-2]
            top_low, sign = np.bitwise_and(top, 1), np.bitwise_and(nxt, 1)
            np.multiply(top_low, np.uint8(128), out=top_low)
            np.multiply(sign, np.uint8(128), out=sign)
            planes[-1] = np.bitwise_or(np.right_shift(top, 1), sign)
            planes[-2] = np.bitwise_or(np.right_shift(nxt, 1), top_low)
        for k in range(elem_size):
            block[:, k] = planes[k]
        # numpy's stubs give ndarray __buffer__ only on 3.12+:
        hasher.update(block)  # type: ignore[arg-type]
    suffix = take(suffix_len, "suffix")
    if pos != len(blob):
        raise _damaged(source, f"{len(blob) - pos} unexpected trailing bytes")
    hasher.update(suffix)
    if hasher.intdigest() != digest:
        raise _damaged(source, "its digest does not match the decoded bytes")
    return prefix, suffix


def _decode_planes_v1(blob: memoryview, bound: int, source: str) -> bytearray:
    """Decode the first float-aware layout (whole planes, sign rotated through every byte)."""

    if len(blob) < _HEADER_V1.size:
        raise _damaged(source, "shorter than its header")
    magic, elem_size, rotate, raw_len, digest = _HEADER_V1.unpack_from(blob)
    if magic != _MAGIC_V1 or elem_size not in _UINT or rotate > 1:
        raise _damaged(source, "bad header")
    if raw_len > bound:
        raise CorruptCheckpointError(
            f"{source}: a compressed item declares {raw_len} bytes, more than the {bound} its "
            "metadata allows; refusing to inflate it"
        )
    count, tail_len = divmod(raw_len, elem_size)
    pos = _HEADER_V1.size + elem_size * _PLANE_V1.size
    if len(blob) < pos:
        raise _damaged(source, "truncated plane index")
    out = bytearray(raw_len)
    columns = np.frombuffer(out, dtype=np.uint8, count=count * elem_size).reshape(-1, elem_size)
    for k in range(elem_size):
        mode, length = _PLANE_V1.unpack_from(blob, _HEADER_V1.size + k * _PLANE_V1.size)
        chunk = blob[pos:pos + length]
        if len(chunk) != length:
            raise _damaged(source, f"plane {k} is truncated")
        plane: memoryview | bytes
        if mode == _RAW:
            plane = chunk
        elif mode == _ZSTD:
            plane = decode_zstd(chunk, count, source)
        else:
            raise _damaged(source, f"plane {k} has unknown mode {mode}")
        if len(plane) != count:
            raise _damaged(source, f"plane {k} holds {len(plane)} bytes, expected {count}")
        columns[:, k] = np.frombuffer(plane, dtype=np.uint8)
        pos += length
    tail = blob[pos:]
    if len(tail) != tail_len:
        raise _damaged(source, f"{len(tail)} trailing bytes, expected {tail_len}")
    if rotate:
        words = columns.view(_UINT[elem_size]).reshape(-1)
        low = words >> 1
        words <<= 8 * elem_size - 1
        words |= low
    out[count * elem_size:] = tail
    if xxhash.xxh3_64_intdigest(out) != digest:
        raise _damaged(source, "its digest does not match the decoded bytes")
    return out


def decode(descriptors: Sequence[str], blob: bytes | bytearray, bound: int, source: str,
           ) -> bytes | bytearray:
    """Undo the transforms named by DCP's per-item descriptors (outermost first)."""
    for descriptor in descriptors:
        if descriptor == ZSTD_DESCRIPTOR:
            blob = decode_zstd(blob, bound, source)
        elif descriptor in PLANES_READABLE:
            blob = decode_planes(blob, bound, source)
        else:
            raise CorruptCheckpointError(
                f"{source}: item uses transform {descriptor!r}, which this statereg cannot "
                "decode; upgrade statereg or check the checkpoint's origin"
            )
    return blob


class EncodingStream(io.RawIOBase):
    """Collects one item's bytes (torch.save's output); on close writes their encoding.

    The write whose length is `body_size` (the tensor's bytes, which torch.save passes as one
    view of the tensor's own memory) is kept as that view, not copied; every other write is
    copied at once (torch.save reuses those buffers). `encode(prefix, body, suffix, write)`
    then streams the encoding into `output`, which is left open.
    """

    def __init__(self, output: IO[bytes] | io.RawIOBase,
                 encode: Callable[[bytes, memoryview | None, bytes, Callable[[Any], Any]], None],
                 body_size: int = -1) -> None:
        super().__init__()
        self._output = output
        self._encode = encode
        self._body_size = body_size
        self._parts: list[bytearray] = [bytearray()]
        self._body: memoryview | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._body is None and len(view) == self._body_size and len(view) >= _KEEP_VIEW:
            self._body = view
            self._parts.append(bytearray())
        else:
            self._parts[-1] += view
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        prefix = bytes(self._parts[0])
        suffix = bytes(self._parts[1]) if len(self._parts) > 1 else b""
        with _CODEC_SLOTS:
            self._encode(prefix, self._body, suffix, self._output.write)
        self._parts, self._body = [bytearray()], None


def encode_zstd_parts(prefix: bytes, body: memoryview | None, suffix: bytes,
                      settings: CompressionSettings, write: Callable[[Any], Any]) -> None:
    """One standard zstd frame of `prefix + body + suffix`, streamed through `write`."""
    total = len(prefix) + len(suffix) + (len(body) if body is not None else 0)
    compressor = _generic(settings).compressobj(size=total)
    for part in (prefix, body, suffix):
        if part is not None and len(part):
            write(compressor.compress(part))
    write(compressor.flush())


class FloatPlanes(StreamTransformExtension):
    """DCP extension entry for `statereg.planes`, so DCP's registry can decode it too.

    Plain DCP readers can load float-aware checkpoints with
    `FileSystemReader(path, _extension_registry=statereg.dcp.codec.extension_registry())`.
    """

    @staticmethod
    def registry_name() -> str:
        return PLANES_NAME

    @staticmethod
    def from_descriptor(version: str) -> FloatPlanes:
        if f"{PLANES_NAME}/{version}" not in PLANES_READABLE:
            raise ValueError(f"statereg.planes version {version!r} is not supported")
        return FloatPlanes()

    def get_descriptor(self) -> str:
        return PLANES_DESCRIPTOR

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        raise NotImplementedError("statereg encodes planes per item; see BackendWriter")

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        # Plain DCP gives no item size to bound by; statereg's own reader does.
        return io.BytesIO(decode_planes(input.read(), 1 << 62, PLANES_NAME))


def extension_registry() -> Any:
    """DCP's extension registry with statereg's float-aware decoder added.

    Raises StateregError on a torch without DCP's extension registry (see torch_private.py):
    statereg's own reader still loads every compressed checkpoint there.
    """
    if not EXTENSIONS_AVAILABLE:
        raise StateregError(
            f"torch {torch.__version__} has no torch.distributed.checkpoint._extension, so plain "
            "DCP readers cannot decode compressed items; load the checkpoint with statereg "
            "(CheckpointManager.load or statereg.load_model_from), which decodes them itself"
        )
    registry = ExtensionRegistry()
    registry.register(FloatPlanes)
    return registry
