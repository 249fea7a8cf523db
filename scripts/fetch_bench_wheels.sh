#!/usr/bin/env bash
# Download the wheels the benchmark's CPU engines need on the GPU machine (which has no
# package registry) into .whl/ (ignored by git). There:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl
#   unzip -o -q -j .whl/tbb-*.whl '*/libtbb.so.2' '*/libtbbmalloc.so.2' -d /tmp/site/lib
#   export PYTHONPATH=/tmp/site:$PWD/src LD_LIBRARY_PATH=/tmp/site/lib
# (pip --target drops the tbb wheel's data files, so its libtbb for PISA is unzipped by hand.)
#
# Targets Python 3.12 on manylinux x86_64 (the GPU image's python3). Packages the image
# already has (numpy, torch, requests, jinja2, packaging, tqdm, ...) are not fetched: two
# versions of one package would stop the install. Wheels already in .whl/ are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
mkdir -p "$DEST"
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

WHEELS=(
  # the engines
  msgspec==0.19.0           # core: the JSONL reader (the GPU image lacks it)
  pyseismic-lsr==0.5.2      # the last release with a cp312 manylinux wheel
  bmp==0.2.8
  pyterrier-pisa==0.4.9
  tbb==2020.3.254           # libtbb.so.2 for PISA's extension
  # what `import pyterrier_pisa` imports and the GPU image lacks
  pyterrier==1.1.2
  pyterrier-alpha==0.16.5
  enum-tools==0.13.0
  ir-datasets==0.6.3
  ir-measures==0.4.3
  deprecated==1.3.1
  wrapt==2.5.2
  lz4==4.4.5
  more-itertools==11.2.1
  pandas==3.1.1
  python-dateutil==2.9.0.post0
  six==1.17.0
  tzdata==2026.6
  pygments==2.21.0
  dill==0.4.1
)
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$w"
done
du -ch "$DEST"/*.whl | tail -1
echo "wheels in $DEST:"; ls -1 "$DEST"
