#!/usr/bin/env bash
# Keep the working tree the device tool sends under its 64 MiB (docs/training.md, "GPU check on
# the device machine"). The loss study's committed starts (results/loss-study-v2/cells/starts/*/
# model.pt and features.pt, about 57 MB) are tracked, and with .whl (7 MB) the tree is over the
# limit. `aside` moves them into the ignored .device-aside/ before a device call, `back` restores
# them (byte for byte: git status is clean again). The GPU check never reads them.
#
#   bench/device_tree.sh aside     # then the device call(s), with carry [".whl"]
#   bench/device_tree.sh back
set -euo pipefail
cd "$(dirname "$0")/.."
ASIDE=.device-aside
case "${1:-}" in
aside)
    for file in results/loss-study-v2/cells/starts/*/model.pt results/loss-study-v2/cells/starts/*/features.pt; do
        [ -f "$file" ] || continue
        mkdir -p "$ASIDE/$(dirname "$file")"
        mv "$file" "$ASIDE/$file"
    done
    echo "device_tree: tracked files now $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes (limit 67108864 with what is carried)"
    ;;
back)
    [ -d "$ASIDE" ] || { echo "device_tree: nothing aside"; exit 0; }
    (cd "$ASIDE" && find . -type f) | while read -r file; do
        mkdir -p "$(dirname "$file")"
        mv "$ASIDE/$file" "$file"
    done
    rm -rf "$ASIDE"
    git status --short -- results/loss-study-v2/cells/starts
    ;;
*)
    echo "usage: bench/device_tree.sh aside|back" >&2
    exit 2
    ;;
esac
