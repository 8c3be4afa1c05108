# `nix run .#bench`: bench/gpu/run.sh of the checkout it is started in, with the service's Python
# (gpu extra included) as $PYTHON and the service's run-time environment. It runs from the
# working tree, not from a store copy, so results land in the checkout's bench/results/.
{
  callPackage,
  lib,
  makeWrapper,
  python3,
  runCommand,
  writeShellScript,
}:

let
  runtime = callPackage ./runtime.nix { };
  env = python3.withPackages (
    ps: [ ps.semif-serve ] ++ ps.semif-serve.optional-dependencies.gpu ++ import ./test-tools.nix ps
  );
  launcher = writeShellScript "semif-serve-bench-launcher" ''
    if [ ! -f bench/gpu/run.sh ]; then
      echo "semif-serve-bench: start it from the root of a semif-serve checkout (no bench/gpu/run.sh in $PWD)" >&2
      exit 2
    fi
    exec bash bench/gpu/run.sh "$@"
  '';
in
runCommand "semif-serve-bench"
  {
    nativeBuildInputs = [ makeWrapper ];
    meta.mainProgram = "semif-serve-bench";
  }
  ''
    makeWrapper ${launcher} $out/bin/semif-serve-bench \
      --set PYTHON ${env.interpreter} \
      --prefix PATH : ${env}/bin \
      ${lib.escapeShellArgs runtime.makeWrapperArgs}
  ''
