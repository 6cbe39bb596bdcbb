#!/usr/bin/env bash
# flash_attn's own tests/test_flash_attn.py on flashattn2 (install_as_flash_attn, conftest.py here), sampled:
# PEER_PER_FUNC cases of each test function per seed (SEEDS), PEER_LIMIT seconds a seed, -n PEER_WORKERS.
#   bash tools/peer/run.sh PATH/TO/test_flash_attn.py      (flash-attention's file: not kept in this repo)
# Needs a GPU (the module reads the device's capability on import) and einops.
set -uo pipefail
src=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
cp "$here/conftest.py" "$src" "$work/"
cd "$work"
export PYTHONPATH=$here/../../src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for seed in ${SEEDS:-0 1}; do
  echo "== seed $seed"
  PEER_SEED=$seed timeout "${PEER_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -n "${PEER_WORKERS:-14}" -rf \
    -c /dev/null --rootdir . "$(basename "$src")"
done
