# fla-core: the triton kernels of flash-linear-attention (the `fla` package's ops and modules).
# nixpkgs has no fla-core; this is the PyPI sdist that flash-linear-attention 0.5.2 pins.
{
  buildPythonPackage,
  fetchPypi,
  lib,

  # build-system
  setuptools,
  wheel,

  # dependencies
  einops,
  packaging,
  torch,
  triton,
}:

buildPythonPackage rec {
  pname = "fla-core";
  version = "0.5.2";
  pyproject = true;

  src = fetchPypi {
    pname = "fla_core";
    inherit version;
    hash = "sha256-k2D8QS94TByPBcMg7CkC1dlodkF4ybipLvyRnhejloA=";
  };

  build-system = [
    setuptools
    wheel
  ];

  # The `cuda` extra (torch, triton) is what the service needs, so it is part of the package.
  dependencies = [
    einops
    packaging
    torch
    triton
  ];

  # The kernels need a GPU; without one `import fla` only warns and picks the CPU.
  doCheck = false;
  pythonImportsCheck = [ "fla" ];

  meta = {
    description = "Core triton operations of flash-linear-attention";
    homepage = "https://github.com/fla-org/flash-linear-attention";
    license = lib.licenses.mit;
    platforms = lib.platforms.linux;
  };
}
