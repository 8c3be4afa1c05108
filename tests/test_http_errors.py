"""The one error mapping (C3): every exception becomes a status, a code and the JSON envelope."""

import json
import logging

import falcon
import pytest
from falcon import testing

from semif_serve.errors import InvalidRequest, ScoringFailed, ServerBusy
from semif_serve.http.errors import classify, envelope, handle_error


def test_a_falcon_error_keeps_its_description_else_its_title():
    described = falcon.HTTPBadRequest(title="Bad", description="the body is odd")
    assert classify(described) == (400, "bad_request", "the body is odd", {})
    titled = falcon.HTTPError(falcon.HTTP_418, title="short and stout")
    assert classify(titled) == (418, "http_error", "short and stout", {})
    bare = falcon.HTTPError(falcon.HTTP_418)
    bare.title = None
    assert classify(bare)[2] == "request failed"


def test_an_unknown_exception_is_a_logged_500_scoring_failed(caplog):
    error = KeyError("secret detail")
    assert classify(error) == (500, "scoring_failed", "internal error: KeyError", {})
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "unhandled error while serving a request"
    assert record.exc_info[1] is error


def test_our_errors_carry_their_message_and_headers():
    assert classify(ServerBusy("full")) == (
        429,
        "busy",
        "full",
        {"Retry-After": "1", "retry-after-ms": "1000"},
    )
    assert classify(ScoringFailed("broke")) == (500, "scoring_failed", "broke", {})


def test_the_envelope_keeps_non_ascii_text_as_is():
    assert envelope("busy", "café") == '{"error": {"code": "busy", "message": "café"}}'


def test_the_envelope_writes_what_utf_8_cannot_encode_as_its_escape():
    # A lone surrogate quoted from a request: the body must still encode (issue 21, finding 5).
    text = envelope("invalid_request", "key 'k\ud800' café \udfff")
    assert json.loads(text.encode())["error"] == {
        "code": "invalid_request",
        "message": "key 'k\\ud800' café \\udfff",
    }


def handled(error, method="PUT", path="/x"):
    req = falcon.Request(testing.create_environ(path=path, method=method))
    resp = falcon.Response()
    handle_error(req, resp, error, {})
    return resp, req


@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        (falcon.HTTPNotFound(), 404, "no such endpoint: PUT /x"),
        (falcon.HTTPMethodNotAllowed(["GET"]), 405, "PUT is not allowed on /x"),
        (falcon.HTTPBadRequest(description="odd"), 400, "odd"),
        (falcon.HTTPNotAcceptable(description="no"), 406, "no"),
        (ServerBusy("full"), 429, "full"),
    ],
)
def test_only_falcon_s_404_and_405_get_our_own_wording(error, status, message):
    resp, req = handled(error)
    assert resp.status == status
    assert resp.content_type == falcon.MEDIA_JSON
    assert json.loads(resp.data)["error"]["message"] == message
    assert req.context.error_code == json.loads(resp.data)["error"]["code"]


def test_an_error_quoting_a_lone_surrogate_still_sends_its_envelope_as_bytes():
    resp, req = handled(InvalidRequest("unknown workload '\ud800'"))
    assert resp.status == 422 and isinstance(resp.data, bytes)
    assert json.loads(resp.data)["error"] == {
        "code": "invalid_request",
        "message": "unknown workload '\\ud800'",
    }
    assert req.context.error_code == "invalid_request"
