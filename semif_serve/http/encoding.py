"""Decode a request body's Content-Encoding (gzip, zstd) without ever holding more than the limit.

The TypeSafe SDK sends bodies of 1 KiB or more as `Content-Encoding: zstd` whenever zstd is
available to it, and gzip is what proxies and curl send. SEMIF_MAX_BODY_BYTES counts the DECODED
bytes: the decoder is asked for at most the limit + 1 bytes of output in total, so a small frame
that would inflate to a gigabyte costs the limit + one step of work, then a 413. Several frames
(zstd) or members (gzip) one after another are one body, as their formats define, up to
MAX_FRAMES (more is a 400); each is decoded from where the last one ended, its input handed over
in INPUT_STEP pieces, so the work is linear in the body's bytes whatever its framing. An
encoding the server does not decode is a 415 naming it; a damaged or cut-off stream is a 400.
"""

from __future__ import annotations

import sys
import zlib

from semif_serve.errors import BadRequest, RequestTooLarge, UnsupportedEncoding

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

ENCODINGS = ("gzip", "zstd")  # besides identity
GZIP_WBITS = 16 + zlib.MAX_WBITS  # a gzip header and trailer, never raw deflate or zlib
# Frames (gzip members) in one body at most: the SDKs and curl send one; each costs a decoder.
MAX_FRAMES = 64
INPUT_STEP = 1 << 16  # bytes of input handed to a decoder at a time


def coding(header: str | None) -> str | None:
    """The one content coding named by a Content-Encoding header; None: identity (no coding).
    A list of codings, or one the server does not decode, is a 415."""
    name = (header or "").strip().lower()
    if name in ("", "identity"):
        return None
    if name not in ENCODINGS:
        raise UnsupportedEncoding(
            f"Content-Encoding: {header.strip()!r} is not supported; send identity, gzip or zstd"
        )
    return name


def decoded(data: bytes, name: str | None, limit: int) -> bytes:
    """`data` decoded from coding `name` (None: as it is); RequestTooLarge past `limit` decoded
    bytes, BadRequest when the stream is damaged, ends inside a frame or holds more than
    MAX_FRAMES frames (members)."""
    if name is None:
        return data
    decode_frame = _zstd_frame if name == "zstd" else _gzip_frame
    out = bytearray()
    output = _Output(out, limit, name)
    view = memoryview(data)
    offset = frames = 0
    while offset < len(view):  # one frame (member) at a time, from where the last one ended
        frames += 1
        if frames > MAX_FRAMES:
            raise BadRequest(
                f"body: more than {MAX_FRAMES} {name} frames (members) in one body; send it as one"
            )
        offset += decode_frame(view[offset:], output)
    return bytes(out)


class _Output:
    """The decoded bytes so far, refusing any past the limit."""

    def __init__(self, out: bytearray, limit: int, name: str):
        self.out, self.limit, self.name = out, limit, name

    @property
    def room(self) -> int:
        """How much a decoder may return next: one byte past the limit tells it was passed."""
        return self.limit - len(self.out) + 1

    def keep(self, chunk: bytes) -> None:
        self.out += chunk
        if len(self.out) > self.limit:
            raise RequestTooLarge(
                f"the body decodes ({self.name}) to more than the limit of {self.limit} bytes"
            )

    def truncated(self) -> BadRequest:
        return BadRequest(f"body: the {self.name} stream ends inside a frame")

    def damaged(self, error: Exception) -> BadRequest:
        return BadRequest(f"body: not valid {self.name} data ({error})")


def _zstd_frame(data: memoryview, output: _Output) -> int:
    """Decode the frame `data` starts with into `output`; how many bytes of `data` it took.
    The input goes in INPUT_STEP pieces, so what the decoder copies after the frame's end
    (`unused_data`) is at most one piece, however much of the body follows."""
    decoder = zstd.ZstdDecompressor()
    fed = 0
    piece: bytes | memoryview  # a fresh decoder needs input: the first pass feeds it
    try:
        # Each pass reads input or writes output, so this many passes always reach the end.
        for _ in range(len(data) + output.room):
            if decoder.needs_input:
                if fed == len(data):
                    break
                piece, fed = data[fed : fed + INPUT_STEP], min(len(data), fed + INPUT_STEP)
            chunk = decoder.decompress(piece, max_length=output.room)
            piece = b""
            output.keep(chunk)
            if decoder.eof:
                return fed - len(decoder.unused_data)
    except zstd.ZstdError as error:
        raise output.damaged(error) from None
    raise output.truncated()


def _gzip_frame(data: memoryview, output: _Output) -> int:
    """`_zstd_frame` for one gzip member (the input in INPUT_STEP pieces as well)."""
    decoder = zlib.decompressobj(wbits=GZIP_WBITS)
    piece, fed = data[:INPUT_STEP], min(len(data), INPUT_STEP)
    try:
        for _ in range(len(data) + output.room):
            chunk = decoder.decompress(piece, output.room)
            output.keep(chunk)
            if decoder.eof:
                return fed - len(decoder.unused_data)
            piece = decoder.unconsumed_tail
            if not piece and not chunk:  # everything given was read, nothing more came out
                if fed == len(data):
                    break
                piece, fed = data[fed : fed + INPUT_STEP], min(len(data), fed + INPUT_STEP)
    except zlib.error as error:
        raise output.damaged(error) from None
    raise output.truncated()
