#!/usr/bin/env bash
# Packs what the cutile JIT needs on a GPU machine that reaches no package index, where
# cuda-tile[tileiras] is installed: the cuda-tile wheel for Python 3.12 and tileiras with the
# ptxas and libnvvm of its release, in two xz parts (about 57 MiB in all). The cutile-jit
# stage of bench/gpu_run.sh unpacks the parts present in .carry/ into .tileiras/ and runs
# the test once all are there:
#
#   bash bench/pack_tileiras.sh
#   copy .carry/ (tileiras-1.tar.xz, tileiras-2.tar.xz, wheels/) and build/cutile there,
#   then: bash bench/gpu_run.sh cutile-jit
set -euo pipefail
cd "$(dirname "$0")/.."
out=.carry
rm -rf "$out/wheels"
mkdir -p "$out/wheels"
cu13=$(python3 -c "import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])")
for f in bin/tileiras bin/ptxas lib/libnvvm.so.4; do
    [[ -f $cu13/$f ]] || { echo "no $cu13/$f: pip install 'cuda-tile[tileiras]'" >&2; exit 1; }
done
version=$(python3 -c "import cuda.tile; print(cuda.tile.__version__)")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d "$out/wheels" "cuda-tile==$version"
tar -C "$cu13" -cf - bin/tileiras | xz -9 -T0 > "$out/tileiras-1.tar.xz"
tar -C "$cu13" -cf - bin/ptxas lib/libnvvm.so.4 | xz -9 -T0 > "$out/tileiras-2.tar.xz"
ls -l "$out" "$out/wheels"
