"""Decode a request body's Content-Encoding (gzip, zstd) without ever holding more than the limit.

The TypeSafe SDK sends bodies of 1 KiB or more as `Content-Encoding: zstd` whenever zstd is
available to it, and gzip is what proxies and curl send. SEMIF_MAX_BODY_BYTES counts the DECODED
bytes: the decoder is asked for at most the limit + 1 bytes of output in total, so a small frame
that would inflate to a gigabyte costs the limit + one step of work, then a 413. Several frames
(zstd) or members (gzip) one after another are one body, as their formats define. An encoding
the server does not decode is a 415 naming it; a damaged or cut-off stream is a 400.
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
    bytes, BadRequest when the stream is damaged or ends inside a frame."""
    if name is None:
        return data
    decode_frame = _zstd_frame if name == "zstd" else _gzip_frame
    out = bytearray()
    rest = data
    while rest:  # one frame (member) at a time: each returns the input after it
        rest = decode_frame(rest, _Output(out, limit, name))
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


def _zstd_frame(data: bytes, output: _Output) -> bytes:
    decoder = zstd.ZstdDecompressor()
    try:
        chunk = decoder.decompress(data, max_length=output.room)
        while True:
            output.keep(chunk)
            if decoder.eof:
                return decoder.unused_data
            if decoder.needs_input:  # all of the input read, and the frame not ended
                raise output.truncated()
            chunk = decoder.decompress(b"", max_length=output.room)
    except zstd.ZstdError as error:
        raise output.damaged(error) from None


def _gzip_frame(data: bytes, output: _Output) -> bytes:
    decoder = zlib.decompressobj(wbits=GZIP_WBITS)
    try:
        chunk = decoder.decompress(data, output.room)
        # Each pass reads input or writes output, so this many passes always reach the end.
        for _ in range(len(data) + output.room):
            output.keep(chunk)
            if decoder.eof:
                return decoder.unused_data
            tail = decoder.unconsumed_tail
            chunk = decoder.decompress(tail, output.room)
            if not chunk and not tail and not decoder.eof:
                break
    except zlib.error as error:
        raise output.damaged(error) from None
    raise output.truncated()
