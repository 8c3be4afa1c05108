# flash-linear-attention 0.5.2: the layers transformers calls for Qwen3.5's linear attention.
# nixpkgs has an older release built without fla-core; this is the PyPI sdist, pinned by hash.
{
  buildPythonPackage,
  fetchPypi,
  lib,

  # build-system
  setuptools,
  wheel,

  # dependencies
  fla-core,
  transformers,
}:

buildPythonPackage rec {
  pname = "flash-linear-attention";
  version = "0.5.2";
  pyproject = true;

  src = fetchPypi {
    pname = "flash_linear_attention";
    inherit version;
    hash = "sha256-wFPTp1yPW3JQY/cZrmvOD02drG2jJzW+iufUhabJgg8=";
  };

  build-system = [
    setuptools
    wheel
  ];

  dependencies = [
    fla-core
    transformers
  ];

  doCheck = false; # the tests need a GPU
  pythonImportsCheck = [ "fla.layers" ];

  meta = {
    description = "Fast linear attention layers and models on top of fla-core";
    homepage = "https://github.com/fla-org/flash-linear-attention";
    license = lib.licenses.mit;
    platforms = lib.platforms.linux;
  };
}
