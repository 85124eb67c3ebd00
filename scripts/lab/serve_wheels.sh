#!/usr/bin/env bash
# Here (a machine with PyPI): download the wheels SGLang's HTTP server (`fp serve`) imports that
# ../shared/device/stage.py does not pack (it packs the embedded engine's import closure), into
# .whl/ (git-ignored, ~2.2 MB). Seen missing on the device on 2026-11-30: jsonschema (and its
# referencing / rpds-py / jsonschema-specifications), soundfile (cffi, pycparser) and
# python-multipart.
#
#   bash scripts/lab/serve_wheels.sh
#   device call, carry [".whl"]:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whlsite .whl/*.whl &&
#     export PYTHONPATH=$PWD/kernels:$PWD:$PYTHONPATH:/tmp/whlsite      # appended: never shadows
set -euo pipefail
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    jsonschema jsonschema-specifications referencing rpds-py soundfile cffi pycparser python-multipart
ls .whl
