#!/bin/sh
# Apply the patch series onto a vLLM tree and fail unless every pinned file
# is overlaid. The image build runs this against the image's own vLLM; the
# unit tests run this same script against a copy of the CPU venv's files.
#
#   PYTHON        interpreter whose vllm is the default target (python3)
#   OVERLAY_REPO  the overlay checkout: pin.toml, patches/ (this script's ..)
#   TARGET        an installed vllm package dir or a vLLM source root
#                 (default: the vllm package of $PYTHON, found without import)
#   OVERLAY_SERIES apply (default), or none: the series is not applied and
#                 every pinned file must be the base's (the A/B base image)
set -eu

PYTHON="${PYTHON:-python3}"
OVERLAY_REPO="${OVERLAY_REPO:-$(cd "$(dirname "$0")/.." && pwd)}"
if [ -z "${TARGET:-}" ]; then
    TARGET="$("$PYTHON" -c '
import importlib.util, os, sys
spec = importlib.util.find_spec("vllm")
if spec is None or spec.origin is None:
    sys.exit(f"apply-overlay: no vllm package in {sys.executable}; set TARGET")
print(os.path.dirname(spec.origin))
')"
fi

overlay() {
    "$PYTHON" -m vllm_overlay.cli --repo "$OVERLAY_REPO" "$@"
}

case "${OVERLAY_SERIES:-apply}" in
    apply)
        echo "apply-overlay: series from $OVERLAY_REPO onto $TARGET"
        overlay apply --target "$TARGET"
        overlay status --target "$TARGET" --require overlaid
        echo "apply-overlay: every pinned file is overlaid"
        ;;
    none)
        echo "apply-overlay: OVERLAY_SERIES=none: no series applied onto $TARGET"
        overlay status --target "$TARGET" --require base
        echo "apply-overlay: every pinned file is the base's (the A/B base)"
        ;;
    *)
        echo "apply-overlay: OVERLAY_SERIES must be apply or none, not '$OVERLAY_SERIES'" >&2
        exit 2
        ;;
esac
