# What every semif-serve process needs around its Python at run time: gcc for triton and the
# offline switches. One definition for the service, the GPU bench and the dev shell.
{
  cudaPackages,
  lib,
}:

let
  # triton compiles a small C launcher the first time a kernel runs. Without a compiler the
  # warm-up decision fails and the service refuses to start (contract change note). This is the
  # gcc that cudaPackages pairs with nvcc, which nixpkgs' own triton tests use as CC.
  cc = cudaPackages.backendStdenv.cc;
  variables = {
    CC = "${cc}/bin/cc";
    # INV-5: weights come from the local cache only. semif_serve sets these itself at import;
    # the wrapper makes them hold for anything else in the process too.
    HF_HUB_OFFLINE = "1";
    TRANSFORMERS_OFFLINE = "1";
  };
in
{
  inherit cc variables;
  makeWrapperArgs =
    [
      "--prefix"
      "PATH"
      ":"
      (lib.makeBinPath [ cc ])
    ]
    ++ lib.concatLists (
      lib.mapAttrsToList (name: value: [
        "--set"
        name
        value
      ]) variables
    );
}
