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
  # An integer limit from 1 to `most`, the server's own upper bound (semif_serve/config.py,
  # MAX_*_LIMIT): a larger value would pass here and make the server exit 2 at start.
  limitUpTo = most: types.nullOr (types.ints.between 1 most);
  # A number > 0 as the server reads it (float()). toString writes a Nix float with six decimals
  # ("1.500000", which float() reads), so one below 0.000001 would arrive as "0.000000" and be
  # refused (the server wants > 0): such values are refused here instead. An int stays an int.
  positiveNumber =
    types.addCheck types.number (x: x >= 1.0e-6)
    // {
      description = "integer or floating point number, at least 0.000001 (written with six decimals)";
    };

  # --- bind ---------------------------------------------------------------------------------
  # HOST:PORT as the server takes it (semif_serve/config.py, parse_bind: the port is what follows
  # the last colon) and as gunicorn binds it: an IPv6 host in brackets (unbracketed, gunicorn
  # would cut `::1:8471` at its first colon), an IPv4 address or a host name. Stricter than
  # parse_bind where the health check, which polls the same address, needs it: port 0 (the
  # kernel picks a free one, which the check cannot know) and leading zeros are refused, and so
  # are IPv6 zone ids (`[fe80::1%eth0]`: curl's URL would need `%25`).
  octet = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"; # 0-255, no leading zero (octal to inet_aton)
  isIPv4 = text: builtins.match "${octet}(\\.${octet}){3}" text != null;
  # Dot-separated labels of letters, digits and inner hyphens, at most 63 each and 253 in all;
  # digits and dots alone are an IPv4 address or nothing (999.1.1.1, 127.1).
  label = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
  isHostname =
    text:
    builtins.match "${label}(\\.${label})*" text != null
    && builtins.match "[0-9.]+" text == null
    && builtins.stringLength text <= 253;
  # 8 groups of 1-4 hex digits, the last two of which may be written as an IPv4 address, and at
  # most one `::` standing for one or more groups of zeros (inet_pton's rules).
  isIPv6 =
    text:
    let
      halves = lib.splitString "::" text;
      groups = lib.concatMap (half: if half == "" then [ ] else lib.splitString ":" half) halves;
      ipv4Tail = groups != [ ] && !(lib.hasSuffix ":" text) && isIPv4 (lib.last groups);
      hexGroups = if ipv4Tail then lib.init groups else groups;
      width = builtins.length hexGroups + (if ipv4Tail then 2 else 0);
    in
    builtins.length halves <= 2
    && builtins.all (group: builtins.match "[0-9A-Fa-f]{1,4}" group != null) hexGroups
    && (if builtins.length halves == 2 then width <= 7 else width == 8);
  isBind =
    text:
    let
      parts = builtins.match "(.*):([1-9][0-9]{0,4})" text;
      host = builtins.elemAt parts 0;
      bracketed = builtins.match "\\[(.*)]" host;
    in
    parts != null
    && lib.toInt (builtins.elemAt parts 1) <= 65535
    && (
      isIPv4 host || isHostname host || (bracketed != null && isIPv6 (builtins.head bracketed))
    );
  bindType =
    types.addCheck types.str isBind
    // {
      description = "HOST:PORT: an IPv4 address, an IPv6 address in brackets or a host name, and a port from 1 to 65535";
    };

  stateDir = "/var/lib/semif-serve";
  cacheDir = "/var/cache/semif-serve";
  kernelCacheDir = "${stateDir}/kernels";

  # Folders the unit cannot see: ProtectHome=true makes /home, /root and /run/user empty and
  # inaccessible; PrivateTmp=true gives it its own empty /tmp and /var/tmp (a BindReadOnlyPaths
  # under those still works, one under the first three does not: the unit fails to start).
  homeFolders = [
    "/home"
    "/root"
    "/run/user"
  ];
  tmpFolders = [
    "/tmp"
    "/var/tmp"
  ];
  # `path` with repeated slashes, `.` and `..` resolved as the kernel would (symlinks aside), so
  # that //home/alice or /srv/../root count as what they are.
  normalized =
    path:
    let
      step =
        kept: part:
        if part == "" || part == "." then
          kept
        else if part == ".." then
          lib.take (lib.max 0 (builtins.length kept - 1)) kept
        else
          kept ++ [ part ];
    in
    "/" + lib.concatStringsSep "/" (builtins.foldl' step [ ] (lib.splitString "/" path));
  isUnder =
    folders: path:
    let
      resolved = normalized path;
    in
    builtins.any (folder: resolved == folder || lib.hasPrefix "${folder}/" resolved) folders;

  # HOST:PORT (bindType); a wildcard host is probed on loopback.
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
    // cfg.environment; # variables of their own only: see ownVariables

  # Every variable the module sets itself (serviceEnvironment, the start script), with what to do
  # instead. `environment` may not set them: it would bypass the option's type (a SEMIF_MAX_* past
  # the server's bound fails only at start), or break what the unit builds on the value (the
  # health check polls `bind`'s address; DeviceAllow opens the card `gpu` numbers; the stop
  # timeout follows gracefulTimeoutSec), and a token in it would land in the Nix store.
  ownVariables =
    let
      use = option: "use services.semif-serve.${option}, which sets it";
      fixed = why: "fixed by the unit (${why})";
    in
    {
      SEMIF_MODEL = use "model";
      SEMIF_REVISION = use "revision";
      SEMIF_BIND = "use services.semif-serve.bind, which sets it and whose address the health check polls";
      SEMIF_GRACEFUL_TIMEOUT_S = use "gracefulTimeoutSec";
      HF_HUB_CACHE = use "hfCacheDir";
      SEMIF_VRAM_CAP_GIB = use "vramCapGib";
      SEMIF_PREFIX_CACHE_GIB = use "prefixCacheGib";
      SEMIF_MAX_TOKENS = use "maxTokens";
      SEMIF_MAX_DECISIONS = use "maxDecisions";
      SEMIF_MAX_BODY_BYTES = use "maxBodyBytes";
      SEMIF_MAX_QUEUE = use "maxQueue";
      SEMIF_MAX_CONNECTIONS = use "maxConnections";
      SEMIF_HEADER_TIMEOUT_S = use "headerTimeoutSec";
      SEMIF_BODY_TIMEOUT_S = use "bodyTimeoutSec";
      SEMIF_CALIBRATION = use "calibrationFile";
      CUDA_VISIBLE_DEVICES = use "gpu";
      SEMIF_DEVICE = fixed "the one card services.semif-serve.gpu chooses";
      CUDA_DEVICE_ORDER = fixed "services.semif-serve.gpu numbers the cards as nvidia-smi does";
      SEMIF_CACHE_DIR = fixed "the unit's writable folders";
      SEMIF_KERNEL_CACHE_DIR = fixed "the unit's writable folders";
      HOME = fixed "the unit's writable folders";
      XDG_CACHE_HOME = fixed "the unit's writable folders";
      HF_HOME = fixed "the unit's writable folders";
      SEMIF_API_TOKEN = "a token here would land in the Nix store; use services.semif-serve.apiTokenFile";
      SEMIF_ADMIN_TOKEN = "a token here would land in the Nix store; use services.semif-serve.adminTokenFile";
    };

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
      type = types.nullOr positiveNumber; # the server has no upper bound
      default = null;
      example = 12;
      description = "SEMIF_VRAM_CAP_GIB: the share of the card this process may use (unset: uncapped).";
    };

    prefixCacheGib = mkOption {
      # An int or a float in [0, 1024] (MAX_PREFIX_CACHE_GIB; 0: no cache). A float below
      # 0.000001 is written "0.000000": no cache, as good as such a cache anyway.
      type = types.nullOr (types.numbers.between 0 1024);
      default = null;
      example = 16;
      description = ''
        SEMIF_PREFIX_CACHE_GIB: GiB of stored state prefixes (unset: the server's default, 8 on
        a GPU; 0 turns the cache off). Counts against vramCapGib.
      '';
    };

    maxTokens = mkOption {
      type = limitUpTo 1048576; # 2^20, MAX_TOKENS_LIMIT
      default = null;
      description = "SEMIF_MAX_TOKENS (unset: the server's default, 4096).";
    };

    maxDecisions = mkOption {
      type = limitUpTo 65536; # 2^16, MAX_DECISIONS_LIMIT
      default = null;
      description = "SEMIF_MAX_DECISIONS (unset: 64).";
    };

    maxBodyBytes = mkOption {
      type = limitUpTo 1073741824; # 2^30, MAX_BODY_BYTES_LIMIT
      default = null;
      description = "SEMIF_MAX_BODY_BYTES (unset: 1 MiB).";
    };

    maxQueue = mkOption {
      type = limitUpTo 4096; # MAX_QUEUE_LIMIT
      default = null;
      description = "SEMIF_MAX_QUEUE (unset: 32).";
    };

    maxConnections = mkOption {
      type = limitUpTo 65536; # 2^16, MAX_CONNECTIONS_LIMIT
      default = null;
      description = "SEMIF_MAX_CONNECTIONS: open connections the server holds; more wait in the listen backlog (unset: 1000).";
    };

    headerTimeoutSec = mkOption {
      type = types.nullOr positiveNumber; # seconds, fractions too; the server has no upper bound
      default = null;
      description = "SEMIF_HEADER_TIMEOUT_S: a request's line and headers must arrive within this, else the connection is closed (unset: 10).";
    };

    bodyTimeoutSec = mkOption {
      type = types.nullOr positiveNumber; # seconds, fractions too; the server has no upper bound
      default = null;
      description = "SEMIF_BODY_TIMEOUT_S: a request's body must arrive within this after its headers, else 408 (unset: 30).";
    };

    calibrationFile = mkOption {
      type = types.nullOr types.path;
      default = null;
      example = "/etc/semif-serve/calibration.json";
      description = "SEMIF_CALIBRATION: a JSON object {workload: temperature}. Not secret: a Nix path literal is copied to the store. A string path must be one the unit sees: not under /home, /root, /run/user, /tmp or /var/tmp.";
    };

    bind = mkOption {
      type = bindType;
      default = "127.0.0.1:8471";
      example = "[::]:8471";
      description = "SEMIF_BIND, HOST:PORT (an IPv6 address in brackets, a port from 1 to 65535). Open the firewall yourself if it is not loopback.";
    };

    gracefulTimeoutSec = mkOption {
      type = types.ints.between 1 86400; # MAX_WAIT_S, a day
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
      description = ''
        Further environment for the server: variables the module does not set itself. One it sets
        (from an option above, such as SEMIF_BIND, or fixed, such as HOME) or a token fails the
        evaluation, naming the option to use.
      '';
    };
  };

  config = mkIf cfg.enable {
    assertions = [
      {
        assertion = cfg.hfCacheDir == null || !(isUnder homeFolders cfg.hfCacheDir);
        message = "services.semif-serve.hfCacheDir: the unit cannot see /home, /root or /run/user (ProtectHome); move the cache, e.g. to /srv/hf-cache/hub.";
      }
      {
        # A Nix path literal is copied to the store, which the unit sees; a string is read where
        # it points, by the server inside the unit.
        assertion =
          !(builtins.isString cfg.calibrationFile && isUnder (homeFolders ++ tmpFolders) cfg.calibrationFile);
        message = "services.semif-serve.calibrationFile: the unit cannot see /home, /root or /run/user (ProtectHome), nor the host's /tmp and /var/tmp (PrivateTmp); move the file, e.g. to /etc/semif-serve/calibration.json.";
      }
    ]
    ++ lib.mapAttrsToList (name: advice: {
      assertion = !(cfg.environment ? ${name});
      message = "services.semif-serve.environment.${name}: ${advice}.";
    }) ownVariables;

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
