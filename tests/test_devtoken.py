"""The local token `make serve` creates: random, private, reused, and a working curl example."""

import stat

import pytest

from semif_serve.config import ConfigError
from semif_serve.devtoken import curl_example, ensure_token_file


def test_a_token_is_created_private_then_reused(tmp_path):
    path = tmp_path / "token"
    token = ensure_token_file(path)
    assert len(token) >= 32 and all(33 <= ord(c) <= 126 for c in token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token_file(path) == token
    assert ensure_token_file(tmp_path / "other") != token


def test_a_bad_token_in_the_file_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("short\n")
    with pytest.raises(ConfigError, match="SEMIF_API_TOKEN"):
        ensure_token_file(path)


def test_the_curl_example_uses_the_bind_and_the_file(tmp_path):
    text = curl_example("127.0.0.1:9000", tmp_path / "token")
    assert "http://127.0.0.1:9000/decide" in text
    assert f"$(cat {tmp_path / 'token'})" in text
