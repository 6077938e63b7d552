#!/usr/bin/env bash
# Keep the working tree the device tool sends under its 64 MiB (docs/training.md, "GPU check on
# the device machine"). The loss study's committed starts (results/loss-study-v2/cells/starts/*/
# model.pt and features.pt, about 57 MB) are tracked, and with .whl (7 MB) the tree is over the
# limit. `aside` moves them into the ignored .device-aside/ before a device call, `back` restores
# them (byte for byte: git status is clean again). The GPU check never reads them.
#
#   bench/device_tree.sh aside     # then the device call(s), with carry [".whl"]
#   bench/device_tree.sh back
#   bench/device_tree.sh size      # what a call would send now (aside prints it too)
set -euo pipefail
cd "$(dirname "$0")/.."
ASIDE=.device-aside
LIMIT=67108864

# What the device tool sends: the tracked files and the untracked ones git does not ignore (those
# present: the aside ones are gone), and .whl, carried. Summed in one process (xargs would split a
# long list over several du runs, each with its own total); a warning when over the 64 MiB.
tree_size() {
    python3 - "$LIMIT" <<'EOF'
import os
import subprocess
import sys

limit = int(sys.argv[1])
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(name) for name in set(listed) if name and os.path.isfile(name))
carried = sum(os.path.getsize(os.path.join(folder, name))
              for folder, _, names in os.walk(".whl") for name in names)
total = tree + carried
print(f"device_tree: the tree sends {tree} bytes, .whl {carried}: {total} of the device tool's "
      f"{limit} (64 MiB)", flush=True)
if total > limit:
    print(f"device_tree: WARNING: {total} bytes is over the device tool's 64 MiB ({limit}): move "
          "more aside or remove untracked files before the call", file=sys.stderr)
EOF
}
case "${1:-}" in
aside)
    for file in results/loss-study-v2/cells/starts/*/model.pt results/loss-study-v2/cells/starts/*/features.pt; do
        [ -f "$file" ] || continue
        mkdir -p "$ASIDE/$(dirname "$file")"
        mv "$file" "$ASIDE/$file"
    done
    tree_size
    ;;
size)
    tree_size
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
    echo "usage: bench/device_tree.sh aside|back|size" >&2
    exit 2
    ;;
esac
