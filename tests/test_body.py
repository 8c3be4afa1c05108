"""The body reader never keeps more than the limit and never trusts a strange Content-Length."""

import io
import json

import pytest

from semif_serve.errors import (
    BadRequest,
    IncompleteBody,
    InvalidRequest,
    RequestTimeout,
    RequestTooLarge,
)
from semif_serve.http.body import (
    declared_length,
    may_hold_lone_surrogate,
    parse_json_object,
    read_body,
    refuse_lone_surrogates,
)


class Endless(io.RawIOBase):
    """An upload that never ends; records how much was asked for."""

    def __init__(self):
        self.asked = []

    def read(self, size=-1):
        self.asked.append(size)
        return b"x" * size


class Trickle(io.RawIOBase):
    """`total` bytes handed out at most `step` at a time; records how much was asked for."""

    def __init__(self, total, step=100):
        self.left, self.step = total, step
        self.asked = []

    def read(self, size=-1):
        self.asked.append(size)
        given = min(size, self.step, self.left)
        self.left -= given
        return b"z" * given


def environ(stream, length=None):
    env = {"wsgi.input": stream}
    if length is not None:
        env["CONTENT_LENGTH"] = length
    return env


def test_an_endless_upload_is_refused_after_at_most_limit_plus_one_bytes():
    stream = Endless()
    with pytest.raises(RequestTooLarge):
        read_body(environ(stream), limit=1000)
    assert sum(stream.asked) == 1001
    assert max(stream.asked) <= 1001


def test_small_chunks_add_up_to_the_limit_and_no_read_asks_past_it():
    stream = Trickle(total=2000)
    with pytest.raises(RequestTooLarge, match="^the body is over the limit of 1000 bytes$"):
        read_body(environ(stream), limit=1000)
    received = 0
    for asked in stream.asked:
        assert asked == min(64 * 1024, 1000 - received + 1)
        received += min(asked, 100)
    assert received == 1001  # one byte past the limit was read, refused, never kept
    assert read_body(environ(Trickle(total=1000)), limit=1000) == b"z" * 1000


def test_a_declared_length_is_read_to_its_last_byte_and_no_further():
    stream = Trickle(total=10, step=1)
    assert read_body(environ(stream, "3"), limit=10) == b"zzz"
    assert stream.asked == [3, 2, 1]  # never a read after the declared bytes arrived
    assert read_body(environ(io.BytesIO(b"a"), "1"), limit=10) == b"a"


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    stream = Endless()
    with pytest.raises(RequestTooLarge, match="declares 1001 bytes"):
        read_body(environ(stream, "1001"), limit=1000)
    assert stream.asked == []


def test_a_body_at_the_limit_is_read_whole_in_bounded_chunks():
    body = b"y" * 200_000
    assert read_body(environ(io.BytesIO(body), str(len(body))), limit=200_000) == body
    assert read_body(environ(io.BytesIO(body)), limit=200_000) == body  # chunked, no length


def test_only_the_declared_bytes_are_read():
    assert read_body(environ(io.BytesIO(b"abcdef"), "3"), limit=10) == b"abc"


def test_a_body_shorter_than_its_content_length_is_incomplete_never_returned():
    # Issue 13 finding 5: a whole JSON object, a Content-Length 100 bytes larger, then EOF.
    body = b'{"id": "x"}'
    with pytest.raises(IncompleteBody, match=f"ended after {len(body)} of its declared"):
        read_body(environ(io.BytesIO(body), str(len(body) + 100)), limit=10_000)
    with pytest.raises(IncompleteBody, match="ended after 0 of its declared 5 bytes"):
        read_body(environ(io.BytesIO(b""), "5"), limit=10_000)


class Failing(io.RawIOBase):
    """A stream whose first read raises `error`, as gunicorn's body readers do."""

    def __init__(self, error):
        self.error = error

    def read(self, size=-1):
        raise self.error


def test_a_read_past_the_body_deadline_is_a_request_timeout():
    with pytest.raises(RequestTimeout, match="SEMIF_BODY_TIMEOUT_S"):
        read_body(environ(Failing(TimeoutError("timed out")), "10"), limit=100)


def test_malformed_chunked_framing_is_a_bad_request_not_a_500():
    from gunicorn.http.errors import InvalidChunkSize

    with pytest.raises(BadRequest, match=r"^malformed chunked body \(InvalidChunkSize\)$"):
        read_body(environ(Failing(InvalidChunkSize(b"zz"))), limit=100)


@pytest.mark.parametrize("error", [ConnectionResetError(104, "reset"), OSError("no more data")])
def test_a_peer_gone_mid_body_is_an_incomplete_body(error):
    # gunicorn's NoMoreData (a chunked body cut off) is an OSError, like a reset.
    with pytest.raises(IncompleteBody, match="ended before it was complete"):
        read_body(environ(Failing(error)), limit=100)


@pytest.mark.parametrize("length", ["١٠", "²", "+3", "-3", " 3", "3 ", "1_0", "0x3", "3.0"])
def test_a_content_length_that_is_not_ascii_digits_is_bad_request(length):
    with pytest.raises(BadRequest, match="Content-Length must be ASCII digits"):
        declared_length({"CONTENT_LENGTH": length})


def test_an_absent_content_length_means_read_to_the_end():
    assert declared_length({}) is None and declared_length({"CONTENT_LENGTH": ""}) is None
    assert declared_length({"CONTENT_LENGTH": "0"}) == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\xff", "body: must be UTF-8 encoded JSON"),
        (b'{"id": "\xed\xa0\x80"}', "body: must be UTF-8 encoded JSON"),  # U+D800 as raw bytes
        (b"[1]", "body: must be a JSON object, got list"),
        (b"null", "body: must be a JSON object, got NoneType"),
        (b'{"a": NaN}', "body: not valid JSON: NaN is not valid JSON"),
        (b'{"a": -Infinity}', "body: not valid JSON: -Infinity is not valid JSON"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_invalid_with_a_precise_message(body, message):
    with pytest.raises(InvalidRequest) as caught:
        parse_json_object(body)
    assert str(caught.value) == message


def test_a_json_object_body_parses():
    assert parse_json_object('{"é": [1, 2.5]}'.encode()) == {"é": [1, 2.5]}


def test_a_body_deeper_than_the_json_parser_goes_is_a_422_not_a_recursion_error():
    deep = b'{"state": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InvalidRequest) as error:
        parse_json_object(deep)
    assert str(error.value) == "body: JSON nested too deeply"


# --- lone surrogates (issue 21, finding 5) ---------------------------------------------------

LONE = "contains a lone surrogate ({}), which is not valid Unicode text"


@pytest.mark.parametrize(
    ("body", "named", "surrogate"),
    [
        (rb'{"id": "\ud800"}', "id:", r"\ud800"),
        (rb'{"id": "ok", "question": "why\uDFFF?"}', "question:", r"\udfff"),
        (rb'{"options": [{"id": "a"}, {"id": "\udBfF"}]}', "options[1].id:", r"\udbff"),
        (rb'{"state": {"a": [1, {"b": "x\udc00"}]}}', "state.a[1].b:", r"\udc00"),
        (rb'{"state": {"a": {"k\ud800": 1}}}', r'state.a: the key "k\ud800"', r"\ud800"),
        (rb'{"\ud800": 1}', r'body: the key "\ud800"', r"\ud800"),
        (rb'{"s": [["\ude00\ud83d"]]}', "s[0][0]:", r"\ude00"),  # a pair, reversed
        (rb'{"s": "\ud83d\ud83d\ude00"}', "s:", r"\ud83d"),  # a high half, then a pair
    ],
)
def test_a_lone_surrogate_anywhere_is_refused_naming_its_field(body, named, surrogate):
    with pytest.raises(InvalidRequest) as caught:
        parse_json_object(body)
    assert str(caught.value) == f"{named} {LONE.format(surrogate)}"
    str(caught.value).encode()  # the message itself is valid text


def test_the_first_lone_surrogate_in_document_order_is_the_one_named():
    def named(body):
        with pytest.raises(InvalidRequest) as caught:
            refuse_lone_surrogates(body)
        return str(caught.value).partition(":")[0]

    assert named({"a": {"x": ["ok", "\ud800"]}, "b": "\udc00"}) == "a.x[1]"
    assert named({"a": [[], {}, ["\ud800"]], "b": "\udc00"}) == "a[2][0]"
    assert named({"a": "ok", "\ud800": "\udc00"}) == "body"  # a key before its own value
    assert named({"a": {"k\ud800": "\udc00"}}) == "a"
    assert named({"a": ["ok", 1, None, True, 2.5], "b": "\udc00"}) == "b"


@pytest.mark.parametrize(
    "body",
    [
        rb'{"id": "\ud83d\ude00", "s": {"\uD83D\uDE00": ["\ud83d\ude00"]}}',  # pairs: one U+1F600
        rb'{"id": "\\ud800"}',  # an escaped backslash: the six characters \ud800, no surrogate
        rb'{"id": "\ud7ff\ue000"}',  # either side of the surrogates
    ],
)
def test_surrogate_pairs_and_text_that_only_looks_like_an_escape_are_accepted(body):
    value = parse_json_object(body)
    assert value == json.loads(body)
    json.dumps(value, ensure_ascii=False).encode()  # renders as UTF-8


def test_a_lone_surrogate_at_the_bottom_of_a_deep_body_is_named_without_recursion():
    depth = 900  # about what the JSON parser itself allows
    body = b'{"s": ' + b"[" * depth + rb'"\ud800"' + b"]" * depth + b"}"
    with pytest.raises(InvalidRequest) as caught:
        parse_json_object(body)
    assert str(caught.value) == "s" + "[0]" * depth + ": " + LONE.format(r"\ud800")


@pytest.mark.parametrize(
    ("body", "found"),
    [
        (rb'"\ud800"', True),
        (rb'"\uDFFF"', True),
        (rb'"\uDa0f"', True),
        (rb'"\ud83d\ude00"', True),  # a pair: the walk then finds nothing to refuse
        (rb'"\\ud800"', True),  # an escaped backslash: a needless walk, never a miss
        (rb'"\ud7ff"', False),
        (rb'"\ue000"', False),
        (rb'"\u00e9 d800 ud800 \\x \\uzd80"', False),
        ("\U0001f600 é".encode(), False),
    ],
)
def test_only_a_body_that_escapes_a_surrogate_is_walked(body, found):
    assert may_hold_lone_surrogate(body) is found


def test_a_body_without_a_surrogate_escape_is_not_walked(monkeypatch):
    walked = []
    monkeypatch.setattr("semif_serve.http.body.refuse_lone_surrogates", walked.append)
    parse_json_object('{"id": "é😀", "s": ["\\u00e9"]}'.encode())
    assert walked == []
    parse_json_object(rb'{"id": "\ud83d\ude00"}')
    assert walked == [{"id": "\U0001f600"}]
