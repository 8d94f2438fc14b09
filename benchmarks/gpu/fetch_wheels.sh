#!/usr/bin/env bash
# Download, on this (networked) machine, the wheels an offline GPU machine lacks into .whl/ (git-ignored),
# for `bringup.sh` to install there: hydra-core, omegaconf, antlr4 (built here: PyPI has only its sdist),
# xgrammar, jsonschema and what they need, for CPython 3.12 on x86-64 (the GPU image's Python). The GPU
# image already has torch, triton, transformers, pyarrow, numpy, pytest, pytest-xdist, hypothesis.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  hydra-core==1.3.8 omegaconf==2.3.0 xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core annotated-types \
  typing-inspection typing-extensions jsonschema jsonschema-specifications referencing rpds-py
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
