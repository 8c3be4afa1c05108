# nix/module.nix evaluated with nixpkgs' lib alone (tests/test_nix_module.py): no nixpkgs, no
# store, no build. The NixOS options the module sets are declared here as loose stubs, and `pkgs`
# holds only what the module calls, as derivation-like attrsets whose outPath is a plain string.
#
#   nix-instantiate --eval --strict --json tests/nix/eval-module.nix -A unit \
#     --argstr libDir "$PWD/../shared/nixpkgs-lib/lib" --argstr settingsJson '{"enable": true, ...}'
{
  # nixpkgs' lib folder, an absolute path as a string (`import` takes it without copying it to
  # the store).
  libDir,
  # services.semif-serve's definitions, as JSON (an int stays an int, 1.5 a float).
  settingsJson,
}:

let
  lib = import libDir;
  inherit (lib) mkOption types;

  fakeDerivation = name: {
    type = "derivation"; # what lib.isDerivation, hence types.package, looks at
    inherit name;
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
  };

  # A script's outPath carries its name, text and runtime inputs as JSON, so the unit's Exec*
  # lines can be read back into the scripts they run (`scripts` below): the module keeps the
  # scripts in its `let`, and a string is all the unit holds of them.
  scriptPrefix = "/stub-script:";
  writeShellApplication =
    {
      name,
      text,
      runtimeInputs ? [ ],
    }:
    fakeDerivation name
    // {
      outPath =
        scriptPrefix
        + builtins.toJSON {
          inherit name text;
          runtimeInputs = map (input: input.name) runtimeInputs;
        };
    };

  stubPkgs = {
    inherit writeShellApplication;
    coreutils = fakeDerivation "coreutils";
    curl = fakeDerivation "curl";
  };

  # Only the NixOS options module.nix sets; any other one it touched would fail the evaluation
  # with "The option `...' does not exist".
  nixosStubs = {
    options = {
      assertions = mkOption {
        type = types.listOf types.attrs;
        default = [ ];
      };
      systemd.services = mkOption {
        type = types.attrsOf types.anything;
        default = { };
      };
    };
  };

  evaluated = lib.evalModules {
    modules = [
      ../../nix/module.nix
      nixosStubs
      { _module.args.pkgs = stubPkgs; }
      # What the flake's nixosModules.default adds: the package, as a default.
      { services.semif-serve.package = lib.mkDefault (fakeDerivation "semif-serve"); }
      {
        _file = "the test's settings";
        services.semif-serve = builtins.fromJSON settingsJson;
      }
    ];
  };
  inherit (evaluated) config;

  unit = config.systemd.services.semif-serve or null;

  # "/stub-script:{json}/bin/NAME" back to the script's JSON (the greedy match ends at the last
  # /bin/; the JSON holds no raw newline, which `.` might not match).
  readScript =
    command:
    let
      parts = builtins.match "${lib.escapeRegex scriptPrefix}(.*)/bin/[^/]+" command;
    in
    if parts == null then
      throw "not a stub script: ${command}"
    else
      builtins.fromJSON (builtins.head parts);
in
{
  # Every option's final value: forcing them all is what type-checks every definition.
  settings = config.services.semif-serve;
  inherit unit;
  scripts =
    if unit == null then
      null
    else
      {
        ExecStart = readScript unit.serviceConfig.ExecStart;
        ExecStartPost = readScript unit.serviceConfig.ExecStartPost;
      };
  failedAssertions = map (entry: entry.message) (
    builtins.filter (entry: !entry.assertion) config.assertions
  );
}
