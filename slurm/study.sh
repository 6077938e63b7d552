#!/bin/bash
# A loss study as SLURM array jobs (docs/study-gpu.md). Run it where jobs are submitted (a login
# node, inside tmux or screen: it waits for each round):
#   bash slurm/study.sh configs/study/cc3m-gpu.yaml [key=value ...]
#
# 1. `--stage prepare` here: datasets checked (shards) or made, starting checkpoints (if any).
# 2. Rounds: `--list-cells` writes the cells that can run now to ROUND_DIR/run-<time>-<id>/round-K.txt
#    (the lr sweep; its edge extensions once the round before them is done; the option sweeps;
#    once the sweep is settled, the choice in `selected` and then the final cells), and one array
#    job runs them, one array task per VLC_STUDY_CHUNK cells (slurm/study_cells.sbatch),
#    `sbatch --wait`. Every run of this driver writes its lists to a folder of its own, so it
#    never rewrites a list that an array of an earlier run (still queued or running) reads.
# 3. `--stage report` here: tables, the tested family, figures.
# Idempotent: finished cells are skipped by fingerprint, so running it again resumes. A round that
# lists only cells of the round before (they failed there) stops it with exit 1; an array that
# sbatch refuses (a wrong partition, account, ...) stops it too, with sbatch's message.
#
# VLC_STUDY_CHUNK     cells per array task (a positive integer; default 1)
# VLC_STUDY_PARALLEL  at most this many array tasks at once (sbatch --array=...%N, a positive
#                     integer; default no limit)
# VLC_STUDY_SBATCH    extra sbatch options, e.g. "--partition=gpu --account=me"
# VLC_STUDY_ROUNDS    where the cell lists go (default runs/study-slurm/<config name>)
set -uo pipefail
CONFIG=${1:?usage: bash $0 CONFIG [key=value ...]}
shift
PYTHON=${PYTHON:-python}
CHUNK=${VLC_STUDY_CHUNK:-1}
PARALLEL=${VLC_STUDY_PARALLEL:-}
# Checked before anything runs: a bad value would divide by zero or submit a wrong --array.
if ! [[ $CHUNK =~ ^[1-9][0-9]*$ ]]; then
  echo "vlcontrast study: VLC_STUDY_CHUNK='$CHUNK' is not a positive integer (cells per array task); set it to 1 or more, or unset it for 1" >&2
  exit 2
fi
if [ -n "$PARALLEL" ] && ! [[ $PARALLEL =~ ^[1-9][0-9]*$ ]]; then
  echo "vlcontrast study: VLC_STUDY_PARALLEL='$PARALLEL' is not a positive integer (array tasks at once); set it to 1 or more, or unset it for no limit" >&2
  exit 2
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROUNDS=${VLC_STUDY_ROUNDS:-runs/study-slurm/$(basename "$CONFIG" .yaml)}
mkdir -p "$ROUNDS" || exit 2

study() { "$PYTHON" -m vlcontrast.cli study --config "$CONFIG" "$@"; }

study "$@" --stage prepare || exit $?
LISTS=$(mktemp -d "$ROUNDS/run-$(date +%Y%m%d-%H%M%S)-XXXX") || exit 2
echo "vlcontrast study: this run's cell lists and sbatch logs go to $LISTS"
round=0
previous=""
while :; do
  round=$((round + 1))
  list="$LISTS/round-$round.txt"
  study "$@" --list-cells > "$list" || exit $?
  count=$(grep -c . "$list")
  if [ "$count" -eq 0 ]; then
    break
  fi
  # Every cell listed again was in the round before: they failed there (or another job held
  # them), and would again.
  if [ -n "$previous" ] && ! grep -qvxFf "$previous" "$list"; then
    echo "vlcontrast study: the $count cell(s) of $list did not finish in the round before (failed, or run by another job: a 'held by' line); see their slurm-vlc-study-*.out and the cells' stderr.log, fix, and rerun $0" >&2
    exit 1
  fi
  tasks=$(( (count + CHUNK - 1) / CHUNK ))
  echo "vlcontrast study: round $round: $count cell(s) in $tasks array task(s) ($list)"
  submitted="$LISTS/sbatch-$round.out" refused="$LISTS/sbatch-$round.err"
  # sbatch --wait exits with the array's highest exit code, and 1 when it refuses the job: a
  # submission shows by its "Submitted batch job N" line (with --parsable, N alone).
  # shellcheck disable=SC2086  # VLC_STUDY_SBATCH is a list of options
  { sbatch --wait --array="0-$((tasks - 1))${PARALLEL:+%$PARALLEL}" \
      --export="ALL,VLC_STUDY_CHUNK=$CHUNK" ${VLC_STUDY_SBATCH:-} \
      "$HERE/study_cells.sbatch" "$CONFIG" "$list" "$@" | tee "$submitted"; } 2>"$refused"
  rc=$?
  cat "$refused" >&2
  if ! grep -Eq '^(Submitted batch job )?[0-9]+' "$submitted"; then  # --parsable: the id alone
    message=$(grep . "$refused" | tr '\n' ' ' | sed 's/ *$//')
    echo "vlcontrast study: round $round: sbatch did not submit the array (exit $rc): ${message:-no message}; nothing ran; fix the sbatch options (VLC_STUDY_SBATCH, or the #SBATCH lines of $HERE/study_cells.sbatch) and rerun $0" >&2
    exit $((rc ? rc : 1))
  fi
  if [ $rc -ne 0 ]; then
    echo "vlcontrast study: round $round ended with failed task(s); their cells are listed again"
  fi
  previous=$list
done
study "$@" --stage report
