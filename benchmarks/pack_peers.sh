#!/bin/bash
# Copy what bench_peers reads from the peers' checkouts into a folder a GPU run carries: only the files listed by
# `python benchmarks/peer_code.py --files` (a few hundred KB instead of the checkouts' tens of MB) and the
# pure-Python wheels beside the checkouts (einops, Liger-Kernel, Cut Cross-Entropy). Nothing is committed: OUT
# defaults to .gpu/peers/, which git ignores.
#
#   bash benchmarks/pack_peers.sh DIR [OUT]      # DIR: one checkout per repository, named <owner>+<name>
#
# A checkout or file missing from DIR is reported and left out (bench_peers then skips that peer, saying why).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=${1:?usage: bash benchmarks/pack_peers.sh DIR [OUT]}
OUT=${2:-$ROOT/.gpu/peers}
[ -d "$SRC" ] || { echo "pack_peers.sh: $SRC is not a folder of checkouts"; exit 2; }
SRC=$(cd "$SRC" && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
[ "$SRC" != "$OUT" ] || { echo "pack_peers.sh: DIR and OUT are the same folder"; exit 2; }
FILES=$(python3 "$ROOT/benchmarks/peer_code.py" --files) || exit 1
status=0
for file in $FILES; do
  if [ -f "$SRC/$file" ]; then
    mkdir -p "$OUT/$(dirname "$file")" && cp "$SRC/$file" "$OUT/$file"
  else
    echo "missing: $SRC/$file"; status=1
  fi
done
for wheel in "$SRC"/*.whl; do
  [ -e "$wheel" ] && cp "$wheel" "$OUT/"
done
echo "$OUT: $(du -sh "$OUT" | cut -f1) ($(find "$OUT" -type f | wc -l) files)"
exit $status
