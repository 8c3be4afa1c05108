# causal-conv1d 1.7.0 with its CUDA extension compiled here, against the pinned torch and CUDA.
# Upstream's setup.py otherwise downloads a prebuilt wheel (impossible in a Nix build) unless
# CAUSAL_CONV1D_FORCE_BUILD=TRUE; it reads nvcc's version from $CUDA_HOME/bin/nvcc and passes its
# own -gencode list (sm_75, sm_80, sm_87, sm_90, plus newer ones by CUDA version).
{
  buildPythonPackage,
  cudaPackages,
  fetchPypi,
  lib,
  which,

  # build-system
  ninja,
  setuptools,
  wheel,

  # dependencies
  packaging,
  torch,
}:

# nvcc accepts only some gcc versions: build with the stdenv that cudaPackages pairs with it.
buildPythonPackage.override { stdenv = cudaPackages.backendStdenv; } rec {
  pname = "causal-conv1d";
  version = "1.7.0";
  pyproject = true;

  src = fetchPypi {
    pname = "causal_conv1d";
    inherit version;
    hash = "sha256-MgJ1hJTqp7WXzhwoLfoYiIlQa/y5LK08QH0mc2v80ys=";
  };

  build-system = [
    ninja
    setuptools
    torch
    wheel
  ];

  nativeBuildInputs = [
    cudaPackages.cuda_nvcc
    which # torch.utils.cpp_extension looks nvcc up with `which`
  ];

  buildInputs = with cudaPackages; [
    cuda_cccl # <cub/*>, <thrust/*>
    cuda_cudart # cuda_runtime.h, -lcudart
    libcublas # cublas_v2.h, included through ATen
    libcusolver # cusolverDn.h, included through ATen
    libcusparse # cusparse.h, included through ATen
  ];

  dependencies = [
    packaging
    torch
  ];

  # ninja only drives the extension build; nothing imports it at run time.
  pythonRemoveDeps = [ "ninja" ];

  env = {
    CAUSAL_CONV1D_FORCE_BUILD = "TRUE";
    CUDA_HOME = "${lib.getDev cudaPackages.cuda_nvcc}";
    TORCH_CUDA_ARCH_LIST = lib.concatStringsSep ";" torch.cudaCapabilities;
  };

  preConfigure = ''
    export MAX_JOBS="$NIX_BUILD_CORES"
  '';

  doCheck = false; # the tests need a GPU
  # `import causal_conv1d` loads the compiled causal_conv1d_cuda extension: a missing or
  # unlinkable .so fails the build here, not the service's start.
  pythonImportsCheck = [ "causal_conv1d" ];

  meta = {
    description = "Causal depthwise conv1d in CUDA, with a PyTorch interface";
    homepage = "https://github.com/Dao-AILab/causal-conv1d";
    license = lib.licenses.bsd3;
    platforms = [ "x86_64-linux" ];
    broken = !torch.cudaSupport;
  };
}
