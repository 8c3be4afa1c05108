"""Request bodies in a Content-Encoding (semif_serve/http/encoding.py and `read_json_object`):
identity, gzip and zstd (any case, surrounding whitespace), several frames or members as one
body, damaged and cut-off streams a 400, any other coding or a list of codings a 415 before a
byte is read, SEMIF_MAX_BODY_BYTES counting the decoded bytes (exactly the limit passes, one more
is a 413) and the wire bytes alike, and a bomb (a 32 KiB frame that inflates to 1 GiB) refused
after the decoder produced exactly limit + 1 bytes. Duplicate keys are refused where asked
(`unique_keys`, the ecosystem routes). No server: direct calls and falcon's test client."""

from __future__ import annotations

import functools
import gzip
import io
import json
import random
import struct
import sys
import types
import zlib

import pytest
from fakes import AUTH, FakeScorer, decision, fake_app
from falcon import testing
from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.errors import BadRequest, InvalidRequest, RequestTooLarge, UnsupportedEncoding
from semif_serve.http import encoding
from semif_serve.http.body import parse_json_object, read_json_object
from semif_serve.http.encoding import coding, decoded

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

GIB = 1 << 30
BODY = b'{"state": "s", "decisions": [{"id": "a", "question": "Open?", "options": [{"id": "y", "description": "Yes"}, {"id": "n", "description": "No"}]}]}'


def zstd_rle_frame(size: int, byte: bytes = b" ", block: int = 1 << 17) -> bytes:
    """A zstd frame of `size` copies of `byte` written by hand as RLE blocks (4 bytes per 128
    KiB): the frame header declares its content size (8 bytes), a 128 KiB window, no checksum."""
    header = struct.pack("<I", 0xFD2FB528) + bytes([0b11000000, (17 - 10) << 3])
    blocks, left = [], size
    while left:
        count = min(block, left)
        left -= count
        last = 0 if left else 1
        blocks.append((last | 1 << 1 | count << 3).to_bytes(3, "little") + byte)
    return header + struct.pack("<Q", size) + b"".join(blocks)


@functools.cache
def zstd_bomb() -> bytes:
    return zstd_rle_frame(GIB)


@functools.cache
def gzip_bomb() -> bytes:
    """A gzip member of 64 MiB of zeros (about 64 KiB on the wire)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    return b"".join([*(compressor.compress(zeros) for _ in range(64)), compressor.flush()])


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


ENCODE = {"gzip": gz, "zstd": zstd.compress}


def environ(body: bytes, coding_header: str | None = None, length: bool = True) -> dict:
    env = {"wsgi.input": io.BytesIO(body)}
    if length:
        env["CONTENT_LENGTH"] = str(len(body))
    if coding_header is not None:
        env["HTTP_CONTENT_ENCODING"] = coding_header
    return env


class Metered:
    """A real decoder that hands out at most `step` bytes a call, refuses any call not bounded
    by max_length, and records what each call was asked and produced."""

    def __init__(self, inner, log: list, step: int | None):
        self._inner, self._log, self._step = inner, log, step

    def decompress(self, data, max_length=None):
        assert max_length is not None and max_length > 0, f"unbounded decompress ({max_length})"
        want = max_length if self._step is None else min(max_length, self._step)
        out = self._inner.decompress(data, max_length=want)
        self._log.append((max_length, len(out)))
        return out

    def __getattr__(self, name):  # eof, needs_input, unused_data, unconsumed_tail
        return getattr(self._inner, name)


@pytest.fixture
def metered(monkeypatch):
    """Install metered decoders in encoding.py; `metered.step` caps each call's output."""
    calls: list[tuple[int, int]] = []
    state = types.SimpleNamespace(calls=calls, step=None)

    def zstd_decoder():
        return Metered(zstd.ZstdDecompressor(), calls, state.step)

    def gzip_decoder(wbits):
        assert wbits == 16 + zlib.MAX_WBITS
        return Metered(zlib.decompressobj(wbits=wbits), calls, state.step)

    monkeypatch.setattr(
        encoding,
        "zstd",
        types.SimpleNamespace(ZstdDecompressor=zstd_decoder, ZstdError=zstd.ZstdError),
    )
    monkeypatch.setattr(
        encoding, "zlib", types.SimpleNamespace(decompressobj=gzip_decoder, error=zlib.error)
    )
    state.produced = lambda: sum(produced for _, produced in calls)
    return state


# --- the Content-Encoding header ---------------------------------------------------------------


@pytest.mark.parametrize("header", [None, "", "   ", "identity", "IDENTITY", " Identity\t"])
def test_no_coding_or_identity_is_the_body_as_it_is(header):
    assert coding(header) is None
    assert decoded(b"\x1f\x8b not decoded", coding(header), 100) == b"\x1f\x8b not decoded"


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("gzip", "gzip"),
        ("GZIP", "gzip"),
        (" GZip ", "gzip"),
        ("zstd", "zstd"),
        ("\tZSTD  ", "zstd"),
    ],
)
def test_gzip_and_zstd_are_named_in_any_case_and_whitespace(header, name):
    assert coding(header) == name


@pytest.mark.parametrize(
    "header",
    [
        "br",
        "deflate",
        "x-gzip",
        "compress",
        "gzip, zstd",
        "identity, gzip",
        "gzip,gzip",
        "zstd;q=1",
        "g zip",
    ],
)
def test_any_other_coding_or_a_list_of_codings_is_415_naming_it(header):
    with pytest.raises(UnsupportedEncoding) as raised:
        coding(f" {header} ")
    assert str(raised.value) == (
        f"Content-Encoding: {header!r} is not supported; send identity, gzip or zstd"
    )


# --- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_a_body_decodes_to_its_bytes(name):
    assert decoded(ENCODE[name](BODY), name, 10_000) == BODY
    assert read_json_object(environ(ENCODE[name](BODY), name), 10_000) == json.loads(BODY)


def test_several_zstd_frames_are_one_body():
    frames = zstd.compress(b'{"a": ') + zstd.compress(b"") + zstd.compress(b"[1, 2]}")
    assert decoded(frames, "zstd", 100) == b'{"a": [1, 2]}'
    assert read_json_object(environ(frames, "zstd"), 100) == {"a": [1, 2]}


def test_several_gzip_members_are_one_body():
    members = gz(b'{"a": ') + gz(b"") + gz(b"[1, 2]}")
    assert decoded(members, "gzip", 100) == b'{"a": [1, 2]}'
    assert read_json_object(environ(members, "gzip"), 100) == {"a": [1, 2]}


def skippable(payload: bytes = b"") -> bytes:
    """A zstd skippable frame: decoded to nothing (its payload is skipped)."""
    return struct.pack("<II", 0x184D2A50, len(payload)) + payload


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_up_to_max_frames_are_one_body_and_one_more_is_a_400_naming_the_cap(name):
    frame = ENCODE[name](b"x")
    assert encoding.MAX_FRAMES == 64
    assert decoded(frame * 64, name, 1000) == b"x" * 64
    with pytest.raises(BadRequest) as refused:
        decoded(frame * 65, name, 1000)
    assert str(refused.value) == (
        f"body: more than 64 {name} frames (members) in one body; send it as one"
    )


def test_a_megabyte_of_empty_skippable_frames_is_refused_after_the_cap(metered):
    """Issue 43, finding 1: 131,000 empty skippable frames (1 MiB) took 8.3 s of CPU, each
    frame's decoder handed a copy of the rest of the body: now 64 frames are decoded, then 400."""
    with pytest.raises(BadRequest, match="more than 64 zstd frames"):
        decoded(skippable() * 131_072, "zstd", 1 << 20)
    assert len(metered.calls) == 64


class Counted:
    """A real decoder that counts the input bytes it is handed."""

    handed = 0

    def __init__(self, inner):
        self._inner = inner

    def decompress(self, data, max_length=-1):
        Counted.handed += len(data)
        return self._inner.decompress(data, max_length)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_each_frame_is_decoded_from_where_the_last_ended_not_from_a_copy_of_the_rest(
    name, monkeypatch
):
    """The input a body's decoders are handed is linear in its bytes: before, each frame's
    decoder got all of the rest of the body (here 63 x 1 MiB for a 1 MiB body)."""
    big = random.Random(7).randbytes(1 << 20)  # incompressible: about 1 MiB on the wire
    body = ENCODE[name](b"x") * 63 + ENCODE[name](big)
    Counted.handed = 0
    if name == "zstd":
        fake = types.SimpleNamespace(
            ZstdDecompressor=lambda: Counted(zstd.ZstdDecompressor()), ZstdError=zstd.ZstdError
        )
        monkeypatch.setattr(encoding, "zstd", fake)
    else:
        fake = types.SimpleNamespace(
            decompressobj=lambda wbits: Counted(zlib.decompressobj(wbits=wbits)), error=zlib.error
        )
        monkeypatch.setattr(encoding, "zlib", fake)
    assert decoded(body, name, 2 << 20) == b"x" * 63 + big
    assert Counted.handed <= len(body) + 64 * encoding.INPUT_STEP


FRAMES = st.lists(
    st.tuples(st.sampled_from(["frame", "skippable"]), st.binary(max_size=300)),
    min_size=1,
    max_size=70,
)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(["gzip", "zstd"]),
    frames=FRAMES,
    limit=st.integers(1, 4000),
    cut=st.integers(0, 20),
)
def test_any_sequence_of_frames_decodes_as_the_reference_or_fails_as_it_should(
    name, frames, limit, cut
):
    """Empty, skippable, split and concatenated frames (members), over the cap or the limit,
    the last one cut short: `decoded` gives the payloads joined, or the error the first
    failing frame gives."""
    wire = [
        skippable(payload) if kind == "skippable" and name == "zstd" else ENCODE[name](payload)
        for kind, payload in frames
    ]
    kept = [b"" if kind == "skippable" and name == "zstd" else p for kind, p in frames]
    cut = min(cut, len(wire[-1]) - 1)
    body = b"".join(wire)[: len(b"".join(wire)) - cut]
    expected: tuple[type[Exception], ...] | bytes = b"".join(kept)
    total = 0
    for index, payload in enumerate(kept):
        last_cut = cut and index == len(kept) - 1
        if index == encoding.MAX_FRAMES:
            expected = (BadRequest,)
            break
        total += len(payload)
        if total > limit:  # a cut frame may end before or after it passes the limit
            expected = (RequestTooLarge, BadRequest) if last_cut else (RequestTooLarge,)
            break
        if last_cut:
            expected = (BadRequest,)
    if isinstance(expected, bytes):
        assert decoded(body, name, limit) == expected
    else:
        with pytest.raises(expected):
            decoded(body, name, limit)


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_a_decoder_that_hands_out_its_output_in_pieces_still_gives_the_whole_body(name, metered):
    metered.step = 7
    body = b'{"text": "' + b"abcdefghij" * 30 + b'"}'
    assert decoded(ENCODE[name](body) + ENCODE[name](b" "), name, len(body) + 1) == body + b" "
    assert len(metered.calls) > len(body) // 7  # it took many calls
    assert metered.produced() == len(body) + 1


@pytest.mark.parametrize("name", ["gzip", "zstd"])
@pytest.mark.parametrize("size", [300, 301, 309])
def test_a_last_piece_that_ends_exactly_on_a_call_still_reads_the_stream_s_end(name, size, metered):
    # At 300 bytes the decoder fills its last 10-byte piece before it reads the stream's end: the
    # next call returns nothing and ends the stream, which is no truncation.
    metered.step = 10
    body = b'"' + b"z" * (size - 2) + b'"'
    assert decoded(ENCODE[name](body) + ENCODE[name](body), name, 2 * size) == body + body
    assert metered.produced() == 2 * size


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_the_decoded_size_exactly_at_the_limit_passes_and_one_byte_more_is_413(name, metered):
    body = b'{"a": "' + b"x" * 500 + b'"}'
    wire = ENCODE[name](body)
    assert read_json_object(environ(wire, name), len(body)) == {"a": "x" * 500}
    with pytest.raises(RequestTooLarge) as raised:
        read_json_object(environ(wire, name), len(body) - 1)
    assert str(raised.value) == (
        f"the body decodes ({name}) to more than the limit of {len(body) - 1} bytes"
    )
    assert metered.produced() == len(body) + len(body)  # the whole body, then limit + 1


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_the_limit_counts_every_frame_together(name, metered):
    frames = ENCODE[name](b"x" * 60) + ENCODE[name](b"y" * 60)
    assert decoded(frames, name, 120) == b"x" * 60 + b"y" * 60
    with pytest.raises(
        RequestTooLarge, match=rf"^the body decodes \({name}\) to more than the limit of 100 bytes$"
    ):
        decoded(frames, name, 100)
    assert metered.calls[-1] == (41, 41)  # the second frame was asked for 100 - 60 + 1 bytes


def test_a_zstd_bomb_stops_after_limit_plus_one_bytes(metered):
    bomb = zstd_bomb()
    assert len(bomb) < 33_000
    assert zstd.get_frame_info(bomb).decompressed_size == GIB
    with pytest.raises(RequestTooLarge) as raised:
        read_json_object(environ(bomb, "zstd"), 1 << 20)
    assert str(raised.value) == "the body decodes (zstd) to more than the limit of 1048576 bytes"
    assert metered.produced() == (1 << 20) + 1
    assert metered.calls == [((1 << 20) + 1, (1 << 20) + 1)]


def test_a_zstd_bomb_in_pieces_is_asked_for_no_more_than_the_room_left(metered):
    metered.step = 1000
    with pytest.raises(RequestTooLarge):
        decoded(zstd_bomb(), "zstd", 2500)
    assert metered.calls == [(2501, 1000), (1501, 1000), (501, 501)]


def test_a_gzip_bomb_stops_after_limit_plus_one_bytes(metered):
    bomb = gzip_bomb()
    assert len(bomb) < 70_000
    with pytest.raises(RequestTooLarge) as raised:
        read_json_object(environ(bomb, "gzip"), 100_000)
    assert str(raised.value) == "the body decodes (gzip) to more than the limit of 100000 bytes"
    assert metered.produced() == 100_001
    assert metered.calls == [(100_001, 100_001)]


def test_a_gzip_bomb_in_pieces_is_asked_for_no_more_than_the_room_left(metered):
    metered.step = 1000
    with pytest.raises(RequestTooLarge):
        decoded(gzip_bomb(), "gzip", 2500)
    assert metered.calls == [(2501, 1000), (1501, 1000), (501, 501)]


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_the_wire_size_is_bounded_too(name):
    noise = random.Random(0).randbytes(1000)  # incompressible: over 600 bytes on the wire
    wire = ENCODE[name](noise)
    assert len(wire) > 600
    with pytest.raises(RequestTooLarge) as raised:
        read_json_object(environ(wire, name), 600)
    assert str(raised.value) == f"the body declares {len(wire)} bytes, over the limit of 600"
    with pytest.raises(RequestTooLarge) as raised:
        read_json_object(environ(wire, name, length=False), 600)
    assert str(raised.value) == "the body is over the limit of 600 bytes"


def cuts(wire: bytes) -> list[bytes]:
    return [wire[:n] for n in (1, 5, 12, len(wire) // 2, len(wire) - 1)]


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_a_cut_off_stream_is_a_400(name):
    wire = ENCODE[name](BODY)
    for cut in cuts(wire) + [ENCODE[name](b"{}") + cut for cut in cuts(wire)]:
        with pytest.raises(BadRequest) as raised:
            decoded(cut, name, 10_000)
        assert str(raised.value) == f"body: the {name} stream ends inside a frame", cut


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_a_cut_off_stream_in_pieces_is_a_400(name, metered):
    metered.step = 5
    with pytest.raises(BadRequest, match=f"^body: the {name} stream ends inside a frame$"):
        decoded(ENCODE[name](BODY)[:-1], name, 10_000)


def library_error(name: str, data: bytes) -> str:
    """What the library itself says of `data`."""
    try:
        if name == "zstd":
            zstd.ZstdDecompressor().decompress(data)
        else:
            zlib.decompressobj(wbits=16 + zlib.MAX_WBITS).decompress(data)
    except (zstd.ZstdError, zlib.error) as error:
        return str(error)
    raise AssertionError("the library decoded it")


def corrupted(wire: bytes) -> bytes:
    """The stream with its bytes past the header flipped (and its checksum wrong)."""
    return wire[:12] + bytes(b ^ 0x5A for b in wire[12:])


@pytest.mark.parametrize("name", ["gzip", "zstd"])
@pytest.mark.parametrize(
    "damage",
    [
        lambda wire: b"this is not compressed at all",
        corrupted,
        lambda wire: wire[:-4] + bytes(b ^ 0xFF for b in wire[-4:]),  # a wrong checksum / size
        lambda wire: wire + b"trailing garbage",
    ],
)
def test_a_damaged_stream_is_a_400_quoting_the_decoder(name, damage):
    wire = damage(ENCODE[name](BODY))
    rest = wire
    # the library's words for the first frame that fails (trailing garbage: the second one)
    if wire.startswith(ENCODE[name](BODY)):
        rest = wire[len(ENCODE[name](BODY)) :]
    with pytest.raises(BadRequest) as raised:
        decoded(wire, name, 10_000)
    assert str(raised.value) == f"body: not valid {name} data ({library_error(name, rest)})"


def test_zstd_wrongly_labelled_gzip_is_a_400_and_the_reverse_too():
    with pytest.raises(BadRequest, match=r"^body: not valid gzip data \(.+\)$"):
        decoded(zstd.compress(BODY), "gzip", 10_000)
    with pytest.raises(BadRequest, match=r"^body: not valid zstd data \(.+\)$"):
        decoded(gz(BODY), "zstd", 10_000)
    with pytest.raises(BadRequest, match=r"^body: not valid gzip data \(.+\)$"):
        decoded(zlib.compress(BODY), "gzip", 10_000)  # zlib's own format is not gzip


def test_an_empty_encoded_body_is_not_json():
    with pytest.raises(InvalidRequest, match=r"^body: not valid JSON: Expecting value"):
        read_json_object(environ(b"", "gzip"), 100)


class Unread(io.RawIOBase):
    def read(self, size=-1):
        raise AssertionError("the body was read")


def test_an_unknown_coding_is_refused_before_any_byte_is_read():
    env = {"wsgi.input": Unread(), "CONTENT_LENGTH": "10", "HTTP_CONTENT_ENCODING": "br"}
    with pytest.raises(UnsupportedEncoding, match=r"^Content-Encoding: 'br' is not supported"):
        read_json_object(env, 100)


# --- duplicate keys ----------------------------------------------------------------------------


def test_duplicate_keys_are_refused_only_where_asked():
    body = b'{"a": 1, "x": {"b": 1, "b": 2}, "a": 3}'
    assert parse_json_object(body) == {"a": 3, "x": {"b": 2}}  # JSON's last-wins elsewhere
    assert read_json_object(environ(body), 100) == {"a": 3, "x": {"b": 2}}
    with pytest.raises(InvalidRequest) as raised:
        parse_json_object(body, unique_keys=True)
    assert str(raised.value) == 'body: the key "b" appears twice in one object'
    with pytest.raises(InvalidRequest, match='^body: the key "b" appears twice in one object$'):
        read_json_object(environ(gz(body), "gzip"), 100, unique_keys=True)
    nested = b'{"q": [{"c": 1, "d": 2, "d": 1}]}'
    with pytest.raises(InvalidRequest, match='^body: the key "d" appears twice in one object$'):
        parse_json_object(nested, unique_keys=True)
    later = b'{"x": 1, "y": 2, "b": 1, "z": 0, "b": 2}'  # the key named is the repeated one
    with pytest.raises(InvalidRequest, match='^body: the key "b" appears twice in one object$'):
        parse_json_object(later, unique_keys=True)
    same_text = b'{"k": 1, "K": 2, "k ": 3}'
    assert parse_json_object(same_text, unique_keys=True) == {"k": 1, "K": 2, "k ": 3}


def test_a_duplicate_key_holding_a_lone_surrogate_is_named_by_its_escape():
    with pytest.raises(InvalidRequest) as raised:
        parse_json_object(b'{"\\ud800": 1, "\\ud800": 2}', unique_keys=True)
    assert str(raised.value) == 'body: the key "\\ud800" appears twice in one object'


# --- through the app ---------------------------------------------------------------------------


def post(path: str, body: bytes, headers: dict, **overrides):
    app, scorer = fake_app(FakeScorer(), **overrides)
    response = testing.TestClient(app).simulate_post(
        path, body=body, headers={**AUTH, "Content-Type": "application/json", **headers}
    )
    return response, scorer


SHARED = json.dumps({"state": "s", "decisions": [decision("a")]}).encode()
SYSTEM_ONE = json.dumps(
    {"state": "s", "questions": {"q": {"type": "noul", "instructions": "Open?"}}}
).encode()


@pytest.mark.parametrize("name", ["gzip", "zstd"])
@pytest.mark.parametrize(
    ("path", "body"), [("/decide/shared", SHARED), ("/v1/systemone", SYSTEM_ONE)]
)
def test_an_encoded_body_is_answered_as_the_plain_one(path, body, name):
    response, scorer = post(path, ENCODE[name](body), {"Content-Encoding": name.upper()})
    plain, _ = post(path, body, {})
    assert response.status_code == 200, response.text
    assert len(scorer.calls) == 1
    drop = ("x-request-id", "x-typesafe-request-id")
    assert {k: v for k, v in response.headers.items() if k not in drop} == {
        k: v for k, v in plain.headers.items() if k not in drop
    }


def test_an_unknown_coding_is_a_415_envelope():
    response, scorer = post("/decide/shared", SHARED, {"Content-Encoding": "br"})
    assert response.status_code == 415
    assert response.json == {
        "error": {
            "code": "unsupported_media_type",
            "message": "Content-Encoding: 'br' is not supported; send identity, gzip or zstd",
        }
    }
    response, _ = post("/v1/decisions", SHARED, {"Content-Encoding": "gzip, br"})
    assert response.status_code == 415
    message = "Content-Encoding: 'gzip, br' is not supported; send identity, gzip or zstd"
    assert response.json == {
        "error": {
            "code": "unsupported_media_type",
            "message": message,
            "type": "invalid_request_error",
            "param": None,
        },
        "detail": {"error_type": "invalid_request_error", "message": message},
    }
    assert scorer.calls == []


def test_a_bomb_through_the_app_is_a_413_and_nothing_is_scored(metered):
    response, scorer = post(
        "/v1/systemone", zstd_bomb(), {"Content-Encoding": "zstd"}, max_body_bytes=65_536
    )
    assert response.status_code == 413
    assert response.json["error"] == {
        "code": "request_too_large",
        "message": "the body decodes (zstd) to more than the limit of 65536 bytes",
        "type": "invalid_request_error",
        "param": None,
    }
    assert response.headers["connection"] == "close"
    assert metered.produced() == 65_537
    assert scorer.calls == []


def test_a_damaged_body_through_the_app_is_a_400():
    response, scorer = post("/decide/shared", gz(SHARED)[:-3], {"Content-Encoding": "gzip"})
    assert response.status_code == 400
    assert response.json == {
        "error": {"code": "bad_request", "message": "body: the gzip stream ends inside a frame"}
    }
    assert scorer.calls == []
