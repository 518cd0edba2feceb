#!/usr/bin/env bash
# Unpack the Python sources of PyPI's vLLM wheel for `make compat`.
#
#   tests/compat/setup.sh PYTHON VERSION DEST
#
# PyPI's vllm wheel is a CUDA build: installed with its dependencies it would pull a
# CUDA torch. Only its files are needed: the wheel is downloaded without dependencies
# and unpacked into DEST minus its compiled parts (ELF files: the .so extensions and
# the vllm-rs binary; C++/CUDA sources and headers). With DEST first on PYTHONPATH,
# `import vllm` in PYTHON's venv (.venv, torch 2.13.0+cpu) is that release's Python
# code; the vllm-X.dist-info unpacked beside it makes importlib.metadata report it.
# Nothing is installed into the venv.
#
# Last, vLLM's requirements are checked against the venv: a pure-Python dependency
# outside the release's range is reported (not fatal: the tests are the judge).
set -euo pipefail

py=$1 version=$2 dest=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$dest.partial"' EXIT

"$py" -m pip download -q --no-deps --only-binary=:all: "vllm==$version" -d "$tmp"

rm -rf "$dest" "$dest.partial"
"$py" - "$tmp" "$dest.partial" <<'EOF'
import sys, zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("vllm-*.whl"))
dest = Path(sys.argv[2])
native = (".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".cpp", ".c")
kept = skipped = 0
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        if info.is_dir():
            continue
        if info.filename.endswith(native):
            skipped += 1
            continue
        with zf.open(info) as f:
            if f.read(4) == b"\x7fELF":
                skipped += 1
                continue
        zf.extract(info, dest)
        kept += 1
print(f"compat: {wheel.name}: {kept} files unpacked, {skipped} compiled/native left out")
EOF
mv "$dest.partial" "$dest"

"$py" - "$dest" <<'EOF'
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

# CUDA kernels and the compiled/media packages of the GPU build: absent from a CPU venv
# on purpose. torch stays the venv's CPU build (2.13.0), whatever the release pins.
GPU_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors",
    "instanttensor", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
}
info = next(Path(sys.argv[1]).glob("vllm-*.dist-info"))
dist = metadata.PathDistribution(info)
off = []
for line in dist.metadata.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in GPU_ONLY:
        continue
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        off.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(Version(have), prereleases=True):
        off.append(f"{req} (venv has {have})")
torch = metadata.version("torch")
print(f"compat: vllm {dist.version} on torch {torch}; its pure-Python requirements: "
      + ("all met" if not off else f"{len(off)} NOT met"))
for item in off:
    print(f"compat:   WARNING {item}")
EOF
