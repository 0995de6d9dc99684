#!/usr/bin/env bash
# The GPU acceptance run (docs/harness.md, "GPU acceptance"): on a host with at least one GPU,
# from the repository root, with torch, pytest and pytest-xdist installed and no network:
#
#     bash benchmarks/gpu_acceptance.sh OUT_DIR [STAGE ...]
#
# Stages, in this order by default, each under its own timeout and all within BUDGET_S seconds
# (default 570: one 10-minute device command):
#   install   the tree, editable, offline (expecttest from .whl/*.whl when that folder is there)
#   cuda      memory_bound.cuda and the CUDA overlap cell on impl and torch FSDP1 (one GPU:
#             the ranks share it over gloo; a GPU per rank: nccl)
#   overlap   fsdp-conformance overlap --device cuda, and --world-size 1 refused in one line
#   tests     the project's tests, pytest -n auto --durations=30
# Every log goes to OUT_DIR; OUT_DIR/summary.txt has one line per stage (exit status, seconds);
# OUT_DIR/extras.tar.gz the JUnit files and JSON. The script's own exit status is 0 only when
# every stage it ran passed.
set -uo pipefail

OUT=${1:?usage: bash benchmarks/gpu_acceptance.sh OUT_DIR [install cuda overlap tests]}
shift
STAGES=${*:-install cuda overlap tests}
mkdir -p "$OUT/extras"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-570}
failed=0

stage() {  # stage NAME TIMEOUT_S COMMAND...: run COMMAND (within the budget), log and time it
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    [ "$limit" -le $((BUDGET_S - SECONDS)) ] || limit=$((BUDGET_S - SECONDS))
    [ "$limit" -ge 1 ] || limit=1
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    status=$?
    echo "   $name: exit $status after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   | /' >>"$OUT/summary.txt"
    [ "$status" -eq 0 ] || failed=1
    return "$status"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    nproc
    $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count())'
} >"$OUT/environment.txt" 2>&1

SUITE=(-m pytest -p no:cacheprovider --pyargs fsdp_conformance.suite -rA --fsdp-timeout 120)
CUDA_CELLS="cuda_allocator_peak_within_bound or prefetch_overlaps_communication_cuda"

for name in $STAGES; do
    case $name in
    install)
        wheels=(.whl/*.whl)
        if [ -e "${wheels[0]}" ]; then
            stage install-wheels 30 $PY -m pip install -q --no-deps --no-index "${wheels[@]}"
        fi
        stage install 60 $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .
        ;;
    cuda)
        for impl in impl torch-fsdp1; do
            stage "cuda-$impl" 100 $PY "${SUITE[@]}" --fsdp-impl "$impl" -k "$CUDA_CELLS" \
                --junitxml "$OUT/extras/cuda-$impl.xml"
            if grep -q "^SKIPPED" "$OUT/cuda-$impl.log"; then  # they must run on a GPU host
                echo "   cuda-$impl: a CUDA cell was skipped" | tee -a "$OUT/summary.txt"
                failed=1
            fi
        done
        ;;
    overlap)
        stage overlap-cuda 90 $PY -m fsdp_conformance.cli overlap --device cuda \
            --json "$OUT/extras/overlap-cuda.json"
        # must be refused in one line with exit status 2
        stage overlap-ws1 20 bash -c "$PY -m fsdp_conformance.cli overlap --device cuda \
            --world-size 1; test \$? -eq 2"
        ;;
    tests)
        stage tests 540 $PY -m pytest -p no:cacheprovider -n auto --durations=30 -q \
            --junitxml "$OUT/extras/tests.xml"
        ;;
    *)
        echo "unknown stage $name (install cuda overlap tests)" | tee -a "$OUT/summary.txt"
        failed=1
        ;;
    esac
done

tar -czf "$OUT/extras.tar.gz" -C "$OUT" extras && rm -rf "$OUT/extras"
exit "$failed"
