# The deployable semif-serve: the package and its gpu extra in one Python environment, behind a
# wrapper that puts gcc on PATH for triton and keeps the Hugging Face libraries offline.
# `nix run . -- serve` runs it; the NixOS module runs it as a systemd service.
{
  callPackage,
  lib,
  makeWrapper,
  python3,
  runCommand,
}:

let
  runtime = callPackage ./runtime.nix { };
  semif-serve = python3.pkgs.semif-serve;
  env = python3.withPackages (ps: [ ps.semif-serve ] ++ ps.semif-serve.optional-dependencies.gpu);
in
runCommand "semif-serve-${semif-serve.version}"
  {
    nativeBuildInputs = [ makeWrapper ];
    passthru = { inherit env; };
    meta = semif-serve.meta // {
      description = "semif-serve with CUDA torch, triton, flash-linear-attention and causal-conv1d";
      mainProgram = "semif-serve";
    };
  }
  ''
    makeWrapper ${env.interpreter} $out/bin/semif-serve \
      --add-flags "-m semif_serve" \
      ${lib.escapeShellArgs runtime.makeWrapperArgs}
  ''
