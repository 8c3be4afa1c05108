"""The body reader never keeps more than the limit and never trusts a strange Content-Length."""

import io

import pytest

from semif_serve.errors import BadRequest, RequestTooLarge
from semif_serve.http.body import declared_length, read_body


class Endless(io.RawIOBase):
    """An upload that never ends; records how much was asked for."""

    def __init__(self):
        self.asked = []

    def read(self, size=-1):
        self.asked.append(size)
        return b"x" * size


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


@pytest.mark.parametrize("length", ["١٠", "²", "+3", "-3", " 3", "3 ", "1_0", "0x3", "3.0"])
def test_a_content_length_that_is_not_ascii_digits_is_bad_request(length):
    with pytest.raises(BadRequest, match="Content-Length must be ASCII digits"):
        declared_length({"CONTENT_LENGTH": length})


def test_an_absent_content_length_means_read_to_the_end():
    assert declared_length({}) is None and declared_length({"CONTENT_LENGTH": ""}) is None
    assert declared_length({"CONTENT_LENGTH": "0"}) == 0
