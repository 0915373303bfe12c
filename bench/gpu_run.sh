#!/usr/bin/env bash
# On a CUDA machine: install layerbench, run the conformance suite (by default on its GPU
# selection) and the benchmark (the official shapes), and write results/<gpu>/ (results.json, results.md, speedup.png) from every
# run kept under results/<gpu>/raw/ (this run's raw files are added as raw/run-<commit>/).
# Logs and raw files go to $OUT (default ./out/gpu); the conformance log is appended to.
#
#   bash bench/gpu_run.sh [all|conformance|bench|collect|study|kernels|plans|compare|cutile|cutile-jit|cupy|sanitize|ncu]
#   BACKENDS="torch-sdpa triton" SHAPES=official KEXPR="not s14" bash bench/gpu_run.sh
#   STUDIES="attention; narrow --shapes 2,3" bash bench/gpu_run.sh study
#   SANITIZE_BACKEND=wmma SANITIZE_SHAPES="2 7 13" bash bench/gpu_run.sh sanitize
#   bash bench/gpu_run.sh kernels     # wmma kernel tests, GEMM tiles, attention kernels, ceiling
#   WMMA_PLANS="pdl:2,1 persistent:8" bash bench/gpu_run.sh plans  # wmma options on and off
#   OLD_TREE=scratch_old/layerbench bash bench/gpu_run.sh compare  # kernel times, old and new
#   bash bench/gpu_run.sh cutile      # cutile kernel tests and kernel sweeps, products, plans, profile
#   bash bench/gpu_run.sh cutile-jit  # the AOT-against-JIT test (bench/pack_tileiras.sh)
#   bash bench/gpu_run.sh cupy        # cupy kernel tests, an option on/off, attention and GEMM sweeps, GPU time per kernel
#   NCU_BACKEND=cupy NCU_SHAPE=13 NCU_KERNEL=flash_attention [NCU_SOURCE=1] bash bench/gpu_run.sh ncu
#   (NCU_OPTIONS="--option whole_block=True": one_forward.py's backend options)
# The cutile backend needs its cubins: export them where cuda-tile is installed
# (python -m layerbench.backends.cutile.export --arch sm_90 --sweep --out build/cutile)
# and bring build/cutile along.
# The benchmark's own contract checks join the conformance cases (one JSON line each), so a
# peer that misses the contract there keeps its verdict. A copy of the tree without its git
# history records the commit given as LAYERBENCH_COMMIT.
# KEXPR is a pytest -k expression; EXTRA adds more pytest arguments; STUDIES holds
# ';'-separated arguments of bench/tile_sweep.py (rows to $OUT/study-N.json, log study.log).
set -uo pipefail
stage=${1:-all}
OUT=${OUT:-out/gpu}
BACKENDS=${BACKENDS:-all}
SHAPES=${SHAPES:-}  # default: conformance on the suite's GPU selection, bench on official
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The cutile backend runs the cubins exported into build/cutile (copied to this machine).
export LAYERBENCH_CUTILE_BUILD=${LAYERBENCH_CUTILE_BUILD:-$PWD/build/cutile}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
backend_args=()
for b in $BACKENDS; do backend_args+=(--backend "$b"); done
python3 -c "import json; from layerbench.common import provenance as p; \
json.dump(p.collect(), open('$OUT/provenance.json', 'w'), indent=1)"
gpu=$(python3 -c "from layerbench.common.provenance import gpu_slug; print(gpu_slug())")
status=0
# A conformance (or full) run starts a fresh case log; a benchmark run adds its checks to it.
[[ $stage == all || $stage == conformance ]] && rm -f "$OUT/conformance.jsonl"
if [[ $stage == all || $stage == conformance ]]; then
    # Without SHAPES: the official shapes, official 1, 8 and 13 non-causal, and the head dims.
    python3 -m pytest conformance "${backend_args[@]}" ${SHAPES:+--shapes "$SHAPES"} -q -p no:cacheprovider \
        --results-file "$OUT/conformance.jsonl" ${KEXPR:+-k "$KEXPR"} $EXTRA 2>&1 | tee -a "$OUT/conformance.log"
    status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $stage == all || $stage == bench ]]; then
    # The benchmark alone: bench's other tests (reports, SASS, the command line) are CPU
    # tests, and its JSON is written only when pytest ends.
    python3 -m pytest bench/test_bench.py "${backend_args[@]}" --shapes "${SHAPES:-official}" -q -p no:cacheprovider \
        --benchmark-json "$OUT/bench.json" --benchmark-columns=median,iqr,rounds \
        --results-file "$OUT/conformance.jsonl" \
        --benchmark-sort=fullname ${KEXPR:+-k "$KEXPR"} $EXTRA 2>&1 | tee -a "$OUT/bench.log"
    status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $stage == study ]]; then
    IFS=';' read -ra studies <<< "${STUDIES:-}"
    n=0
    for study in "${studies[@]}"; do
        n=$((n + 1))
        # shellcheck disable=SC2086  # each study is a list of arguments
        python3 bench/tile_sweep.py $study --out "$OUT/study-$n.json" 2>&1 | tee -a "$OUT/study.log"
        status=$((status | ${PIPESTATUS[0]}))
    done
fi
if [[ $stage == kernels ]]; then
    # The wmma kernels on their own: kernel tests, every GEMM tile on odd sizes (checked) and
    # on the official shapes' GEMMs (timed), every attention kernel at shapes 13 and 14, and
    # the device's wmma ceiling (register-resident products only); the layer's options are
    # the plans stage.
    log="$OUT/kernels.log"
    python3 -m pytest conformance/test_wmma.py --backend wmma -q -p no:cacheprovider \
        2>&1 | tail -15 | tee -a "$log"
    status=$((status | ${PIPESTATUS[0]}))
    python3 bench/wmma_sweep.py edges --out "$OUT/edges.json" 2>&1 | tail -20 | tee -a "$log"
    status=$((status | ${PIPESTATUS[0]}))
    python3 bench/wmma_sweep.py gemm --rounds 10 --out "$OUT/gemm.json" 2>&1 | tee -a "$log"
    python3 bench/wmma_sweep.py attention --batch 64 --seq-len 1024 --heads 4 --head-dim 32 \
        --out "$OUT/attention-13.json" 2>&1 | tee -a "$log"
    python3 bench/wmma_sweep.py attention --batch 1 --seq-len 100000 --heads 16 --head-dim 64 \
        --rounds 5 --out "$OUT/attention-14.json" 2>&1 | tee -a "$log"
    python3 bench/wmma_sweep.py peak --out "$OUT/peak.json" 2>&1 | tee -a "$log"
fi
if [[ $stage == plans ]]; then
    # The wmma layer with one option on against off, on whole layers (WMMA_PLANS: items
    # 'plan:shapes' of bench/wmma_sweep.py plans). By default: the stream tile of the long
    # calls (the resident-weight and the 64x128 variants against the 16-warp 128x128 one;
    # shape 6's forwards run out_proj and the FFN with three products, where the resident
    # variant runs its plain 8-warp loop), norm_split's row-in-registers kernel, programmatic
    # dependent launches and the persistent GEMM tile.
    for item in ${WMMA_PLANS:-resident:13,6,5 narrow:13,6 norm-registers:8,13,1 \
                 pdl:2,3,1,5,12,8,13 persistent:8}; do
        python3 bench/wmma_sweep.py plans --plan "${item%%:*}" --shapes "${item#*:}" \
            --out "$OUT/plans-${item%%:*}.json" 2>&1 | tee -a "$OUT/plans.log"
        status=$((status | ${PIPESTATUS[0]}))
    done
fi
if [[ $stage == compare ]]; then
    # The current tree against an older one in OLD_TREE, a layerbench copy without results
    # (`git archive <commit> backends bench common conformance reference conftest.py
    # pyproject.toml | tar -x -C scratch_old/layerbench`; scratch_old/ is ignored by git, so
    # copy it to the GPU machine by name): GPU time per kernel of one forward of
    # COMPARE_BACKEND (wmma) on COMPARE_SHAPES (13,6,2,8) in each, the old tree first, to
    # $OUT/compare-old.json and compare-new.json.
    old=$(cd "${OLD_TREE:?OLD_TREE: a folder holding an older layerbench}" && pwd)
    out=$(cd "$OUT" && pwd)
    profile=(bench/tile_sweep.py profile --backend "${COMPARE_BACKEND:-wmma}"
             --shapes "${COMPARE_SHAPES:-13,6,2,8}")
    # The old copy is imported as layerbench from its parent folder, ahead of the install.
    (cd "$old" && PYTHONPATH="$(dirname "$old")" python3 "${profile[@]}" \
        --out "$out/compare-old.json") 2>&1 | tee -a "$OUT/compare.log"
    status=$((status | ${PIPESTATUS[0]}))
    python3 "${profile[@]}" --out "$out/compare-new.json" 2>&1 | tee -a "$OUT/compare.log"
    status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $stage == cutile ]]; then
    # The cutile kernels on their own: kernel tests, then each GEMM, attention, LayerNorm and
    # fused residual-norm choice of the build (exported with --sweep) on the official shapes'
    # sizes, two product counts, lean pairs, programmatic launches and the whole-block kernel
    # on and off, and the GPU time per kernel of one forward of shapes 5, 8 and 13.
    log="$OUT/cutile.log"
    python3 -m pytest conformance/test_cutile.py --backend cutile -q -p no:cacheprovider \
        2>&1 | tail -15 | tee -a "$log"
    status=$((status | ${PIPESTATUS[0]}))
    python3 bench/cutile_sweep.py gemm --out "$OUT/cutile-gemm.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py attention --batch 64 --seq-len 1024 --heads 4 --head-dim 32 \
        --out "$OUT/cutile-attention-13.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py attention --batch 1 --seq-len 100000 --heads 16 \
        --head-dim 64 --rounds 3 --repeats 1 --out "$OUT/cutile-attention-14.json" \
        2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py attention --batch 64 --seq-len 128 --heads 4 --head-dim 256 \
        --out "$OUT/cutile-attention-8.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py norm --out "$OUT/cutile-norm.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py residual-norm --out "$OUT/cutile-residual-norm.json" \
        2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py products --shapes 13,6 --products 2,3 --padding 0.25 \
        --out "$OUT/cutile-products.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py plans --plan lean --shapes 8,5,13 \
        --out "$OUT/cutile-plans-lean.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py plans --plan pdl --shapes 2,1,7,12,5,13 \
        --out "$OUT/cutile-plans-pdl.json" 2>&1 | tee -a "$log"
    python3 bench/cutile_sweep.py plans --plan block --shapes 2,3,4,1,7,9,10,11,12,5 \
        --out "$OUT/cutile-plans-block.json" 2>&1 | tee -a "$log"
    python3 bench/tile_sweep.py profile --backend cutile --shapes 5,8,13 \
        --out "$OUT/cutile-profile.json" 2>&1 | tee -a "$log"
fi
if [[ $stage == cupy ]]; then
    # The cupy kernels: kernel tests, one option on and off on whole layers (CUPY_PLAN,
    # default wgmma), the attention kernels at shapes 14 (one sequence) and 13, the GEMM
    # variants on shape 8's and 14's GEMM sizes, then GPU time per kernel.
    # Each part is time-limited, so a kernel that hangs costs one part, not the call.
    # CUPY_PARTS picks parts (default all: tests plans attention gemm profile);
    # CUPY_PLAN_LIMIT is the plans part's time limit in seconds (default 150).
    log="$OUT/cupy.log"
    parts=" ${CUPY_PARTS:-tests plans attention gemm profile} "
    if [[ $parts == *" tests "* ]]; then
        # CUPY_TEST_K: a -k expression, spaces and all; CUPY_TEST_ARGS: more arguments
        timeout "${CUPY_TEST_LIMIT:-420}" python3 -m pytest conformance/test_cupy.py \
            --backend cupy -q -p no:cacheprovider -rf --maxfail 40 \
            ${CUPY_TEST_K:+-k "$CUPY_TEST_K"}${CUPY_TEST_ARGS:+ $CUPY_TEST_ARGS} >"$log" 2>&1
        status=$((status | $?))
        tail -40 "$log"
    fi
    if [[ $parts == *" plans "* ]]; then
        timeout "${CUPY_PLAN_LIMIT:-150}" python3 bench/cupy_sweep.py plans --plan "${CUPY_PLAN:-wgmma}" \
            --shapes "${CUPY_PLAN_SHAPES:-8,13,6,1}" --out "$OUT/cupy-plans.json" 2>&1 | tee -a "$log"
    fi
    if [[ $parts == *" attention "* ]]; then
        timeout 120 python3 bench/cupy_sweep.py attention --batch 1 --seq-len 100000 \
            --heads 16 --head-dim 64 --rounds 5 --out "$OUT/cupy-attention-14.json" 2>&1 | tee -a "$log"
        timeout 60 python3 bench/cupy_sweep.py attention --batch 64 --seq-len 1024 --heads 4 \
            --head-dim 32 --repeats 10 --out "$OUT/cupy-attention-13.json" 2>&1 | tee -a "$log"
    fi
    if [[ $parts == *" gemm "* ]]; then
        timeout 120 python3 bench/cupy_sweep.py gemm --out "$OUT/cupy-gemm.json" 2>&1 | tee -a "$log"
    fi
    if [[ $parts == *" profile "* ]]; then
        timeout 150 python3 bench/tile_sweep.py profile --backend cupy \
            --shapes "${PROFILE_SHAPES:-2,8,13}" --out "$OUT/cupy-profile.json" 2>&1 | tee -a "$log"
    fi
fi
if [[ $stage == cutile-jit ]]; then
    # The JIT path where no package index is reachable: unpack whichever parts of
    # bench/pack_tileiras.sh are present in .carry/ into .tileiras/; once tileiras, ptxas and
    # libnvvm are all there, install the cuda-tile wheel and run the AOT-against-JIT test.
    mkdir -p .tileiras
    for part in .carry/tileiras-*.tar.xz; do
        [[ -f $part ]] && tar -C .tileiras -xJf "$part"
    done
    if [[ -x .tileiras/bin/tileiras && -x .tileiras/bin/ptxas && -f .tileiras/lib/libnvvm.so.4 ]]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/cutile-site \
            .carry/wheels/cuda_tile-*.whl || { echo "cutile-jit: no cuda-tile wheel"; exit 1; }
        # tileiras takes its ptxas from its own folder unless CUDA_HOME points elsewhere.
        env -u CUDA_HOME PYTHONPATH=/tmp/cutile-site PATH="$PWD/.tileiras/bin:$PATH" \
            python3 -m pytest conformance/test_cutile.py --backend cutile -q -p no:cacheprovider \
            -k "aot_and_jit" -rs 2>&1 | tee -a "$OUT/cutile-jit.log"
        status=$((status | ${PIPESTATUS[0]}))
    else
        echo "cutile-jit: part of tileiras unpacked in .tileiras/; call again with the rest"
    fi
fi
if [[ $stage == sanitize ]]; then
    # compute-sanitizer memcheck and racecheck over one eager forward per shape, each run
    # limited to SANITIZE_LIMIT seconds (exit 124 where it ran out).
    for shape in ${SANITIZE_SHAPES:-2 7 13}; do
        for check in ${SANITIZE_TOOLS:-memcheck racecheck}; do
            echo "## shape $shape $check" | tee -a "$OUT/sanitize.log"
            timeout "${SANITIZE_LIMIT:-900}" compute-sanitizer --tool "$check" --error-exitcode 9 \
                python3 bench/one_forward.py \
                --backend "${SANITIZE_BACKEND:-wmma}" --shape "$shape" --forwards 1 \
                2>&1 | tail -3 | tee -a "$OUT/sanitize.log"
            status=$((status | ${PIPESTATUS[0]}))
        done
    done
fi
if [[ $stage == ncu ]]; then
    # Nsight Compute on NCU_COUNT launches (1) of the kernels whose name matches NCU_KERNEL,
    # after skipping NCU_SKIP of them (0; one forward's launches to profile the second of the
    # two eager forwards of NCU_BACKEND on NCU_SHAPE): speed of light, warp states,
    # scheduler, occupancy, launch, memory and compute sections to $OUT/ncu.txt; clocks left
    # as the GPU sets them. NCU_SOURCE=1 also samples where the warps stall: each SASS
    # instruction's counts and stall samples to $OUT/ncu-source.csv, summarised by
    # bench/ncu_source.py in $OUT/ncu-source.txt.
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    source_args=()
    [[ ${NCU_SOURCE:-0} == 1 ]] && source_args=(--section SourceCounters --export "$OUT/ncu")
    timeout "${NCU_LIMIT:-300}" "$ncu" --clock-control none -k "regex:${NCU_KERNEL:?NCU_KERNEL}" \
        --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-1}" \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis "${source_args[@]}" \
        python3 bench/one_forward.py --backend "${NCU_BACKEND:-cupy}" --shape "${NCU_SHAPE:-13}" \
        --forwards 2 ${NCU_OPTIONS:-} >"$OUT/ncu.txt" 2>&1
    status=$((status | $?))
    if [[ ${NCU_SOURCE:-0} == 1 && -f $OUT/ncu.ncu-rep ]]; then
        # with --export the sections are not printed: print them from the report
        "$ncu" --import "$OUT/ncu.ncu-rep" --page details >>"$OUT/ncu.txt" 2>&1
        "$ncu" --import "$OUT/ncu.ncu-rep" --page source --csv --print-source sass \
            >"$OUT/ncu-source.csv" 2>&1
        python3 bench/ncu_source.py "$OUT/ncu-source.csv" >"$OUT/ncu-source.txt"
        rm -f "$OUT/ncu.ncu-rep"
    fi
    tail -60 "$OUT/ncu.txt"
fi
if [[ $stage == all || $stage == collect ]] && [[ -f $OUT/conformance.jsonl && -f $OUT/bench.json ]]; then
    # Keep this run's raw files next to the results, then rebuild them from every kept run.
    commit=$(python3 -c "import json; print(json.load(open('$OUT/provenance.json'))['commit'])")
    mkdir -p "results/$gpu/raw/run-$commit"
    cp "$OUT/conformance.jsonl" "$OUT/bench.json" "$OUT/provenance.json" "results/$gpu/raw/run-$commit/"
    python3 -m layerbench.common.cli collect --raw "results/$gpu/raw" --out "results/$gpu"
fi
exit $status
