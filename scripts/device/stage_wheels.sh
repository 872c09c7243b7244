#!/usr/bin/env bash
# Download the wheels listed in scripts/device/wheels.txt (cp312, manylinux x86_64) into
# .whl/ for carrying to a GPU machine:   bash scripts/device/stage_wheels.sh [group]
# On the device:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/../.."
group=${1:-}
mkdir -p .whl  # git-ignored (.gitignore)
current=""
while IFS= read -r line; do
  case "$line" in
    "# group: "*) current=$(echo "$line" | sed 's/# group: \([a-z0-9_-]*\).*/\1/'); continue ;;
    ""|\#*) continue ;;
  esac
  if [ -n "$group" ] && [ "$group" != "$current" ]; then continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$line"
done < scripts/device/wheels.txt
ls -la .whl
