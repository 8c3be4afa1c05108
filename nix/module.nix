# services.semif-serve: the HTTP service on one NVIDIA GPU as a hardened systemd unit.
#
# The API token comes from a file through systemd's LoadCredential, so it is never in the Nix
# store, the unit file or the environment of the unit; the start script reads it into
# SEMIF_API_TOKEN of the server process only. The unit counts as started once GET /health
# answers (ExecStartPost), i.e. after the model loaded and the warm-up decision scored; a
# server that fails closed makes the start fail.
{
  config,
  lib,
  pkgs,
  ...
}:

let
  inherit (lib)
    mkEnableOption
    mkIf
    mkOption
    optional
    optionalAttrs
    types
    ;

  cfg = config.services.semif-serve;

  absolutePath = types.strMatching "/.+";
  limit = types.nullOr types.ints.positive;

  stateDir = "/var/lib/semif-serve";
  cacheDir = "/var/cache/semif-serve";
  kernelCacheDir = "${stateDir}/kernels";

  # HOST:PORT as SEMIF_BIND takes it; a wildcard host is probed on loopback.
  bindParts = builtins.match "(.+):([0-9]+)" cfg.bind;
  bindHost = builtins.elemAt bindParts 0;
  probeHost =
    {
      "0.0.0.0" = "127.0.0.1";
      "[::]" = "[::1]";
    }
    .${bindHost} or bindHost;
  healthUrl = "http://${probeHost}:${builtins.elemAt bindParts 1}/health";

  serviceEnvironment =
    {
      SEMIF_MODEL = cfg.model;
      SEMIF_REVISION = cfg.revision;
      SEMIF_DEVICE = "cuda"; # the one card CUDA_VISIBLE_DEVICES leaves visible
      SEMIF_BIND = cfg.bind;
      SEMIF_GRACEFUL_TIMEOUT_S = toString cfg.gracefulTimeoutSec;
      SEMIF_CACHE_DIR = cacheDir; # converted built-in models
      CUDA_DEVICE_ORDER = "PCI_BUS_ID"; # CUDA's numbering = nvidia-smi's
      CUDA_VISIBLE_DEVICES = toString cfg.gpu;
      # A DynamicUser has no writable home: every cache goes under CacheDirectory...
      HOME = stateDir;
      XDG_CACHE_HOME = cacheDir;
      HF_HOME = "${cacheDir}/huggingface";
      # ...except compiled kernels and autotune results (Triton, Inductor, CUDA's JIT cache),
      # which semif-serve points at subfolders of this one folder itself (semif_serve/
      # kernel_cache.py; TRITON_CACHE_DIR and the like set here would override it). They go to
      # the StateDirectory, not the CacheDirectory: systemd treats a cache directory as data
      # the service may lose at any time (`systemctl clean --what=cache` wipes it), while
      # rebuilding these costs tens of seconds of compiling and autotuning at the next start
      # and for every new batch size after it. The state directory survives restarts and
      # reboots; docs/operations.md says when and how to clear it (a new driver or GPU).
      SEMIF_KERNEL_CACHE_DIR = kernelCacheDir;
    }
    // optionalAttrs (cfg.hfCacheDir != null) { HF_HUB_CACHE = cfg.hfCacheDir; }
    // optionalAttrs (cfg.vramCapGib != null) { SEMIF_VRAM_CAP_GIB = toString cfg.vramCapGib; }
    // optionalAttrs (cfg.prefixCacheGib != null) { SEMIF_PREFIX_CACHE_GIB = toString cfg.prefixCacheGib; }
    // optionalAttrs (cfg.maxTokens != null) { SEMIF_MAX_TOKENS = toString cfg.maxTokens; }
    // optionalAttrs (cfg.maxDecisions != null) { SEMIF_MAX_DECISIONS = toString cfg.maxDecisions; }
    // optionalAttrs (cfg.maxBodyBytes != null) { SEMIF_MAX_BODY_BYTES = toString cfg.maxBodyBytes; }
    // optionalAttrs (cfg.maxQueue != null) { SEMIF_MAX_QUEUE = toString cfg.maxQueue; }
    // optionalAttrs (cfg.maxConnections != null) { SEMIF_MAX_CONNECTIONS = toString cfg.maxConnections; }
    // optionalAttrs (cfg.headerTimeoutSec != null) { SEMIF_HEADER_TIMEOUT_S = toString cfg.headerTimeoutSec; }
    // optionalAttrs (cfg.bodyTimeoutSec != null) { SEMIF_BODY_TIMEOUT_S = toString cfg.bodyTimeoutSec; }
    // optionalAttrs (cfg.calibrationFile != null) { SEMIF_CALIBRATION = "${cfg.calibrationFile}"; }
    // cfg.environment;

  start = pkgs.writeShellApplication {
    name = "semif-serve-start";
    text = ''
      # systemd copied the token files to $CREDENTIALS_DIRECTORY (LoadCredential), readable by
      # this unit only; they go into the server's environment here and nowhere else.
      SEMIF_API_TOKEN="$(< "$CREDENTIALS_DIRECTORY/api-token")"
      export SEMIF_API_TOKEN
      if [ -e "$CREDENTIALS_DIRECTORY/admin-token" ]; then
        SEMIF_ADMIN_TOKEN="$(< "$CREDENTIALS_DIRECTORY/admin-token")"
        export SEMIF_ADMIN_TOKEN
      fi
      exec ${cfg.package}/bin/semif-serve serve
    '';
  };

  waitHealthy = pkgs.writeShellApplication {
    name = "semif-serve-wait-healthy";
    runtimeInputs = [
      pkgs.coreutils
      pkgs.curl
    ];
    text = ''
      # Connections queue until the worker has loaded the model and scored the warm-up
      # decision; then /health answers 200. Bounded by startupTimeoutSec.
      limit=${toString cfg.startupTimeoutSec}
      until curl --silent --fail --max-time 5 --output /dev/null ${lib.escapeShellArg healthUrl}; do
        if (( SECONDS >= limit )); then
          echo "semif-serve: ${healthUrl} did not answer 200 within $limit s" >&2
          exit 1
        fi
        sleep 2
      done
    '';
  };
in
{
  options.services.semif-serve = {
    enable = mkEnableOption "semif-serve, SemIf decisions over HTTP on one NVIDIA GPU";

    package = mkOption {
      type = types.package;
      description = "The semif-serve package: the flake's packages.default (set by its module).";
    };

    model = mkOption {
      type = types.str;
      default = "Qwen/Qwen3.5-4B";
      example = "/srv/models/qwen3.5-4b";
      description = "SEMIF_MODEL: a hub id read from hfCacheDir, a local snapshot folder, or builtin:smollm2-135m.";
    };

    revision = mkOption {
      type = types.str;
      default = "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a";
      description = "SEMIF_REVISION: the 40-hex commit of a hub id (a label for a folder).";
    };

    hfCacheDir = mkOption {
      type = types.nullOr absolutePath;
      default = null;
      example = "/srv/hf-cache/hub";
      description = ''
        The Hugging Face hub cache holding the model at `revision` (HF_HUB_CACHE). Bound into
        the unit read-only; nothing is ever downloaded. Its files must be readable by the
        unit's dynamic user: world-readable, or through `supplementaryGroups`.
      '';
    };

    supplementaryGroups = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "hf-cache" ];
      description = "Existing groups the dynamic user joins, e.g. to read hfCacheDir.";
    };

    apiTokenFile = mkOption {
      type = absolutePath;
      example = "/run/secrets/semif-api-token";
      description = ''
        File holding SEMIF_API_TOKEN (at least 32 visible ASCII characters; a trailing newline
        is dropped). Given to the unit with LoadCredential: only root needs to read it, and it
        is never copied to the Nix store. Write it as a string path, not a Nix path literal.
      '';
    };

    adminTokenFile = mkOption {
      type = types.nullOr absolutePath;
      default = null;
      description = "File holding SEMIF_ADMIN_TOKEN (model management); unset: management is refused.";
    };

    gpu = mkOption {
      type = types.ints.unsigned;
      default = 0;
      example = 1;
      description = ''
        The card to use, as nvidia-smi numbers it. The unit may open /dev/nvidia<gpu> and no
        other card, and CUDA_VISIBLE_DEVICES shows it to the server as `cuda`.
      '';
    };

    vramCapGib = mkOption {
      type = types.nullOr (types.either types.ints.positive types.float);
      default = null;
      example = 12;
      description = "SEMIF_VRAM_CAP_GIB: the share of the card this process may use (unset: uncapped).";
    };

    prefixCacheGib = mkOption {
      type = types.nullOr (types.either types.ints.unsigned types.float);
      default = null;
      example = 16;
      description = ''
        SEMIF_PREFIX_CACHE_GIB: GiB of stored state prefixes (unset: the server's default, 8 on
        a GPU; 0 turns the cache off). Counts against vramCapGib.
      '';
    };

    maxTokens = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_MAX_TOKENS (unset: the server's default, 4096).";
    };

    maxDecisions = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_MAX_DECISIONS (unset: 64).";
    };

    maxBodyBytes = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_MAX_BODY_BYTES (unset: 1 MiB).";
    };

    maxQueue = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_MAX_QUEUE (unset: 32).";
    };

    maxConnections = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_MAX_CONNECTIONS: open connections the server holds; more wait in the listen backlog (unset: 1000).";
    };

    headerTimeoutSec = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_HEADER_TIMEOUT_S: a request's line and headers must arrive within this, else the connection is closed (unset: 10).";
    };

    bodyTimeoutSec = mkOption {
      type = limit;
      default = null;
      description = "SEMIF_BODY_TIMEOUT_S: a request's body must arrive within this after its headers, else 408 (unset: 30).";
    };

    calibrationFile = mkOption {
      type = types.nullOr types.path;
      default = null;
      example = "/etc/semif-serve/calibration.json";
      description = "SEMIF_CALIBRATION: a JSON object {workload: temperature}. Not secret: a Nix path literal is copied to the store.";
    };

    bind = mkOption {
      type = types.strMatching ".+:[0-9]+";
      default = "127.0.0.1:8471";
      description = "SEMIF_BIND, HOST:PORT. Open the firewall yourself if it is not loopback.";
    };

    gracefulTimeoutSec = mkOption {
      type = types.ints.positive;
      default = 60;
      description = "SEMIF_GRACEFUL_TIMEOUT_S: how long in-flight requests may finish on stop.";
    };

    startupTimeoutSec = mkOption {
      type = types.ints.positive;
      default = 600;
      description = "How long loading the model and the warm-up may take before the start fails.";
    };

    environment = mkOption {
      type = types.attrsOf types.str;
      default = { };
      example = {
        SEMIF_PARALLEL_SLOTS = "2";
      };
      description = "Further environment for the server (set last, so it overrides the options above). Never put a token here: it would land in the Nix store.";
    };
  };

  config = mkIf cfg.enable {
    assertions = [
      {
        assertion =
          cfg.hfCacheDir == null
          || !(lib.hasPrefix "/home/" cfg.hfCacheDir || lib.hasPrefix "/root/" cfg.hfCacheDir);
        message = "services.semif-serve.hfCacheDir: the unit cannot see /home or /root (ProtectHome); move the cache, e.g. to /srv/hf-cache/hub.";
      }
    ];

    systemd.services.semif-serve = {
      description = "semif-serve: SemIf decisions over HTTP";
      wantedBy = [ "multi-user.target" ];
      after = [ "network.target" ];
      environment = serviceEnvironment;

      # A server that fails closed exits 3 at every start; stop retrying after a few.
      startLimitBurst = 3;
      startLimitIntervalSec = 600;

      serviceConfig = {
        Type = "exec";
        ExecStart = "${start}/bin/semif-serve-start";
        ExecStartPost = "${waitHealthy}/bin/semif-serve-wait-healthy";
        LoadCredential =
          [ "api-token:${cfg.apiTokenFile}" ]
          ++ optional (cfg.adminTokenFile != null) "admin-token:${cfg.adminTokenFile}";
        Restart = "on-failure";
        RestartSec = "10s";
        RestartPreventExitStatus = [ 2 ]; # a configuration error: a restart cannot fix it
        TimeoutStartSec = cfg.startupTimeoutSec + 30;
        TimeoutStopSec = cfg.gracefulTimeoutSec + 15;

        DynamicUser = true;
        SupplementaryGroups = cfg.supplementaryGroups;
        StateDirectory = "semif-serve";
        CacheDirectory = "semif-serve";
        WorkingDirectory = stateDir;
        BindReadOnlyPaths = optional (cfg.hfCacheDir != null) cfg.hfCacheDir;
        UMask = "0077";

        # Devices: the chosen card and the driver's control and unified-memory nodes, nothing else.
        PrivateDevices = false; # true would hide /dev/nvidia*; DevicePolicy does the closing
        DevicePolicy = "closed";
        DeviceAllow = [
          "/dev/nvidia${toString cfg.gpu} rw"
          "/dev/nvidiactl rw"
          "/dev/nvidia-uvm rw"
          "/dev/nvidia-uvm-tools rw"
        ];

        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        NoNewPrivileges = true;
        CapabilityBoundingSet = "";
        ProtectKernelTunables = true;
        ProtectKernelModules = true; # nvidia_uvm must be loaded at boot (boot.kernelModules)
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        RestrictAddressFamilies = [
          "AF_UNIX"
          "AF_INET"
          "AF_INET6"
          "AF_NETLINK"
        ];
        RestrictNamespaces = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        SystemCallArchitectures = "native";
      };
    };
  };
}
