#!/usr/bin/env bash
# Installs the Debian packages lockstep needs. Idempotent: when everything is present it only
# checks (a second or so); `apt-get update` runs only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libopenblas-openmp-dev zlib1g-dev libssl-dev libfmt-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgloo-dev libdnnl-dev
  libcairo2-dev
  iproute2 procps
  slurmctld slurmd slurm-client munge openmpi-bin
  python3
  dataset-fashion-mnist
  fortunes
)

missing=()
for p in "${packages[@]}"; do
  case "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" in
    *"install ok installed"*) ;;
    *) missing+=("$p") ;;
  esac
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
