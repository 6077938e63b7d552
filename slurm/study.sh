#!/bin/bash
# A loss study as SLURM array jobs (docs/study-gpu.md). Run it where jobs are submitted (a login
# node, inside tmux or screen: it waits for each round):
#   bash slurm/study.sh configs/study/cc3m-gpu.yaml [key=value ...]
#
# 1. `--stage prepare` here: datasets checked (shards) or made, starting checkpoints (if any).
# 2. Rounds: `--list-cells` writes the cells that can run now to ROUND_DIR/round-K.txt (the lr
#    sweep; its edge extensions once the round before them is done; the option sweeps; once the
#    sweep is settled, the choice in `selected` and then the final cells), and one array job runs
#    them, one array task per VLC_STUDY_CHUNK cells (slurm/study_cells.sbatch), `sbatch --wait`.
# 3. `--stage report` here: tables, the tested family, figures.
# Idempotent: finished cells are skipped by fingerprint, so running it again resumes. A round that
# lists only cells of the round before (they failed there) stops it with exit 1.
#
# VLC_STUDY_CHUNK     cells per array task (default 1)
# VLC_STUDY_PARALLEL  at most this many array tasks at once (sbatch --array=...%N; default no limit)
# VLC_STUDY_SBATCH    extra sbatch options, e.g. "--partition=gpu --account=me"
# VLC_STUDY_ROUNDS    where the cell lists go (default runs/study-slurm/<config name>)
set -uo pipefail
CONFIG=${1:?usage: bash $0 CONFIG [key=value ...]}
shift
PYTHON=${PYTHON:-python}
CHUNK=${VLC_STUDY_CHUNK:-1}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROUNDS=${VLC_STUDY_ROUNDS:-runs/study-slurm/$(basename "$CONFIG" .yaml)}
mkdir -p "$ROUNDS"

study() { "$PYTHON" -m vlcontrast.cli study --config "$CONFIG" "$@"; }

study "$@" --stage prepare || exit $?
round=0
previous=""
while :; do
  round=$((round + 1))
  list="$ROUNDS/round-$round.txt"
  study "$@" --list-cells > "$list" || exit $?
  count=$(grep -c . "$list")
  if [ "$count" -eq 0 ]; then
    break
  fi
  # Every cell listed again was in the round before: they failed there, and would again.
  if [ -n "$previous" ] && ! grep -qvxFf "$previous" "$list"; then
    echo "vlcontrast study: the $count cell(s) of $list failed in the round before; see their slurm-vlc-study-*.out and the cells' stderr.log, fix, and rerun $0" >&2
    exit 1
  fi
  tasks=$(( (count + CHUNK - 1) / CHUNK ))
  echo "vlcontrast study: round $round: $count cell(s) in $tasks array task(s) ($list)"
  # shellcheck disable=SC2086  # VLC_STUDY_SBATCH is a list of options
  sbatch --wait --array="0-$((tasks - 1))${VLC_STUDY_PARALLEL:+%$VLC_STUDY_PARALLEL}" \
    --export="ALL,VLC_STUDY_CHUNK=$CHUNK" ${VLC_STUDY_SBATCH:-} \
    "$HERE/study_cells.sbatch" "$CONFIG" "$list" "$@" \
    || echo "vlcontrast study: round $round ended with failed task(s); their cells are listed again"
  previous=$list
done
study "$@" --stage report
