#!/usr/bin/env bash
# `make lint`: ruff over the Python code, then every .nix file through `nix-instantiate --parse`
# (syntax and unbound names). nixpkgs cannot be fetched on CI, so this is as much of the Nix code
# as can be checked there; docs/deploy.md lists what a GPU host checks with `nix flake check`.
# On Debian, Nix's parser comes from the nix-bin package, installed here when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

"${RUFF:-.venv/bin/ruff}" check semif_serve tests bench

if ! command -v nix-instantiate >/dev/null; then
  if [ -r /etc/debian_version ] && command -v apt-get >/dev/null; then
    echo "lint: installing Debian's nix-bin for nix-instantiate" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nix-bin >/dev/null
  else
    echo "lint: nix-instantiate not found; install Nix (on Debian: apt-get install nix-bin)" >&2
    exit 1
  fi
fi

# Tracked and new (not ignored) files alike, so a .nix file is checked before its first commit.
mapfile -t nix_files < <(git ls-files --cached --others --exclude-standard -- '*.nix')
if [ "${#nix_files[@]}" -eq 0 ]; then
  echo "lint: no .nix files found (flake.nix is expected)" >&2
  exit 1
fi
for file in "${nix_files[@]}"; do
  [ -f "$file" ] || continue # tracked but deleted in the working tree
  nix-instantiate --parse "$file" >/dev/null
done
echo "lint: ruff clean; ${#nix_files[@]} .nix files parse"
