#!/usr/bin/env bash
# Set up this checkout from nothing: openssh-server and shells (for the test cluster), a venv, torch,
# nodectl[train,test].
# NODECTL_TORCH pins torch; the default is the CPU build this project's CI machine has on disk. On a GPU
# machine set it to the CUDA build you use (e.g. NODECTL_TORCH="torch==2.6.0").
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
# The test cluster: sshd per simulated node, login shells of their own (zsh, fish; dash is /bin/sh), `ip` for
# network namespaces, `unshare`/`nsenter` for mount namespaces (util-linux), iptables for a firewall inside one;
# podman with runc, and debootstrap, for the container tests (their image is built from a Debian root filesystem:
# tests/support/images.py).
NEEDED="openssh-server openssh-client zsh fish iproute2 util-linux iptables podman runc debootstrap"
missing=""
for tool in /usr/sbin/sshd /usr/bin/zsh /usr/bin/fish /usr/bin/podman /usr/sbin/runc /usr/sbin/debootstrap; do
  [ -x "$tool" ] || missing=1
done
command -v ip >/dev/null 2>&1 || missing=1
command -v iptables >/dev/null 2>&1 || missing=1
if [ "${NODECTL_SKIP_APT:-0}" != 1 ] && [ -n "$missing" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq $NEEDED >/dev/null
  else
    echo "note: some of $NEEDED are missing; the SSH integration tests will be skipped" >&2
  fi
fi
VENV=${NODECTL_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "${NODECTL_TORCH:-torch==2.13.0}"
"$VENV/bin/python" -m pip install -q -e ".[train,test]"
# Triton for the experts' LoRA kernel tests, which run it interpreted on the CPU (tests/unit/test_expert_lora.py),
# in a folder of its own: in the venv, every process that imports torch._dynamo (each trainer rank the suite
# starts) would load it too. CUDA builds of torch bring their own.
if [ "$(uname -sm)" = "Linux x86_64" ] && [ ! -d .triton/triton ]; then
  "$VENV/bin/python" -m pip install -q --no-deps --target .triton "triton>=3.2" \
    || echo "note: Triton could not be installed; the expert LoRA kernel tests will be skipped" >&2
fi
echo "set up: $VENV/bin/nodectl"
