#!/usr/bin/env bash
# Run tests/test_gpu.py on a GPU machine that has Python 3.12 and torch with CUDA but not this project's other
# packages, and no network (a lent device machine, an air-gapped node).
#
#   tests/gpu_offline.sh fetch   here, with network: the missing packages' cp312 wheels into .whl/ (git ignores it;
#                                Ray's Java jars are left out, 33 MB the tests never load)
#   tests/gpu_offline.sh run     there, in a copy of the repository with .whl/: installs the wheels into
#                                /tmp/site, runs the GPU tests; log, JUnit report and versions into $OUT (or gpu-out/)
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
fetch)
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
        -d .whl ray==2.60.0 "pydantic>=2,<3" pydantic-core annotated-types typing-inspection \
        jsonschema jsonschema-specifications referencing rpds-py isal || exit 1
    python3 - <<'EOF' || exit 1
import pathlib, zipfile
for wheel in pathlib.Path(".whl").glob("ray-*.whl"):
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith("ray/jars/"):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not line.startswith(b"ray/jars/"))
            dst.writestr(info, data)
    slim.replace(wheel)
EOF
    du -sh .whl
    ;;
run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    { nvidia-smi -L; python3 -c "import sys, torch, ray; print(sys.version.split()[0], torch.__version__, torch.version.cuda, ray.__version__)"; } \
        2>&1 | tee "$out/versions.txt"
    timeout "${GPU_TEST_TIMEOUT_S:-480}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider --junitxml="$out/gpu.xml" 2>&1 | tee "$out/gpu.log"
    ;;
*)
    echo "usage: $0 fetch|run" >&2
    exit 2
    ;;
esac
