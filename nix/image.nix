# The OCI image deploy/k8s runs: the deployable semif-serve (service.nix) and CA certificates,
# as a non-root user, with nothing else in it. `nix build .#image` gives a tarball for
# `docker load` / `podman load`; push it to the registry the cluster pulls from.
# The NVIDIA container toolkit mounts the host's driver libraries (libcuda) into the pod; the
# library path covers where it puts them on common distributions and on GKE.
{
  cacert,
  dockerTools,
  callPackage,
  python3,
}:

let
  service = callPackage ./service.nix { };
in
dockerTools.buildLayeredImage {
  name = "semif-serve";
  tag = python3.pkgs.semif-serve.version;
  contents = [ cacert ];
  config = {
    Entrypoint = [ "${service}/bin/semif-serve" ];
    Cmd = [ "serve" ];
    User = "10001:10001";
    ExposedPorts."8471/tcp" = { };
    Env = [
      "SEMIF_BIND=0.0.0.0:8471"
      "SSL_CERT_FILE=${cacert}/etc/ssl/certs/ca-bundle.crt"
      "LD_LIBRARY_PATH=/usr/lib64:/usr/lib/x86_64-linux-gnu:/usr/local/nvidia/lib64"
    ];
  };
}
