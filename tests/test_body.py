"""The body reader never keeps more than the limit and never trusts a strange Content-Length."""

import io

import pytest

from semif_serve.errors import (
    BadRequest,
    IncompleteBody,
    InvalidRequest,
    RequestTimeout,
    RequestTooLarge,
)
from semif_serve.http.body import declared_length, parse_json_object, read_body


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
