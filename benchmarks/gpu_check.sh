#!/usr/bin/env bash
# The GPU check: what a CUDA machine can tell us that a CPU cannot, in under 10 minutes on one GPU. It expects
# only torch (CUDA), transformers and peft on that machine, and no network: the other packages travel as wheels
# (no dask, pydantic or mlflow needed there beforehand; no vLLM wheel and no model download). A model of
# SmolLM2-135M's real shape with random weights is built there first (benchmarks/gpu_check.py, which holds every
# part; the race's rounds are in benchmarks/_gpu_race.py). docs/gpu.md says what it checks and how to run it.
#
#   1. on a machine with the package registry and the project's .venv:
#        make gpu-carry   (= bash benchmarks/gpu_check.sh prepare)
#      writes build/gpu-carry/wheels: the pure-Python wheels the project needs there and pydantic-core for
#      CPython 3.12 (~8 MiB).
#   2. copy the working tree with build/gpu-carry/wheels to the GPU machine; there:
#        bash benchmarks/gpu_check.sh run           (results in $OUT, else build/gpu-check-out)
#
# Python: $GPU_CHECK_PYTHON when set, else the project's .venv/bin/python when there is one, else python3.
# `run` installs the wheels with pip --no-index --no-deps into a target directory on PYTHONPATH and links the
# project there, builds the model (before anything is timed), then runs each part under its own timeout,
# logging to $OUT/<part>.log and one line per part to $OUT/summary.txt:
#   build    the SmolLM2-shaped model with random weights, and a tokenizer                   (45 s)
#   env      nvidia-smi: the GPU, PCIe generation and width (the swap bound); mem_get_info    (15 s)
#   race     the copy stream against compute: 20 rounds of a train step and a tail of device work on its
#            state, then at once a background eviction and another job's swap-in through the service's
#            moves (1.6 GB AdamW state); host copies and the other job's state compared after a full
#            synchronize; 5 control rounds with the ordering off first (they should tear)       (75 s)
#   bf16     one GRPO iteration in bf16: peak memory next to the planner's estimate          (45 s)
#   lora     one GRPO iteration of a LoRA job, the same figures                               (45 s)
#   nccl1    a 1-rank NCCL worker group: init, fully_shard, train, agree, broadcast, swaps    (45 s)
#   mux      3 jobs on one service whose device budget holds 2: swap GB/s against the PCIe bound, the
#            share of swap time hidden by prefetch                                            (120 s)
#   sessions 8 LoRA sessions over one base, a step each (sample, forward_backward, optim_step): alone one
#            after another against their calls as cohorts (one engine call, one training pass); goal >= 3x (45 s)
#   tests    pytest -m gpu tests/test_gpu.py: the CUDA tests (engine training, service moves, bf16, LoRA) (120 s)
# 555 s at most in all, plus the install (seconds). `run --cpu`: every part on this machine's CPU with a tiny
# model (the script's dry run; tests/test_gpu_check.py runs it). `run --parts race,mux`: only those parts
# (build always runs first unless its model is there). A part that fails or times out is reported and the next
# one runs; the exit status is the number of parts that did not pass.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$ROOT/build/gpu-carry
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python  # a development machine: torch and the rest are in the project's environment
else
    PY=python3  # a GPU machine with torch installed system-wide and the carried wheels
fi
SITE=${GPU_CHECK_SITE:-/tmp/plexrl-gpu-site}
WORK=${GPU_CHECK_WORK:-/tmp/plexrl-gpu-check}  # the model and the jobs' run directories (never $OUT: it travels)

# The packages the project needs that a bare GPU machine (torch, transformers, peft) lacks, at the versions
# of this repository's .venv. pydantic-core is the only compiled one.
WHEELS=(dask distributed pydantic pydantic-core annotated-types typing-inspection importlib-metadata partd
        locket zict tblib tornado math-verify latex2sympy2_extended antlr4-python3-runtime)

die() { echo "gpu_check: $*" >&2; exit 2; }

prepare() {  # here: download the wheels
    local pyver=${GPU_CHECK_PYVER:-3.12} venv_pip=$ROOT/.venv/bin/pip
    [ -x "$venv_pip" ] || die "no $venv_pip: run \`make setup\` first (the versions come from .venv)"
    local dir=$CARRY/wheels
    [ "$pyver" = 3.12 ] || dir=$CARRY/wheels-$pyver
    rm -rf "$dir" && mkdir -p "$dir"
    local specs=() name version
    for name in "${WHEELS[@]}"; do
        version=$("$venv_pip" show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        [ -n "$version" ] || die "$name is not installed in .venv; cannot pin its version"
        specs+=("$name==$version")
    done
    "$ROOT/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$dir" "${specs[@]}" || die "pip download failed"
    echo "wheels: $(ls "$dir" | wc -l) files, $(du -sh "$dir" | cut -f1) in $dir"
}

install() {  # there: the carried wheels and the project into $SITE, on PYTHONPATH
    local dir=$CARRY/wheels
    [ -n "${GPU_CHECK_WHEELS:-}" ] && dir=$GPU_CHECK_WHEELS
    mkdir -p "$SITE"
    if ls "$dir"/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$dir"/*.whl || return 1
    else
        echo "no wheels in $dir: relying on what is installed (make gpu-carry, then carry build/gpu-carry/wheels)"
    fi
    # the project by links: plexrl/ with operators/ and pipelines/ as its subpackages (pyproject's layout)
    rm -rf "$SITE/plexrl" && mkdir -p "$SITE/plexrl"
    ln -s "$ROOT"/plexrl/* "$SITE/plexrl/"
    ln -s "$ROOT/operators" "$SITE/plexrl/operators"
    ln -s "$ROOT/pipelines" "$SITE/plexrl/pipelines"
    # PYTHONSAFEPATH: no cwd or script directory in front of sys.path, where the repository's plexrl/ (without
    # its operators/ and pipelines/) would shadow the linked one; benchmarks/ for their helpers
    export PYTHONSAFEPATH=1 PYTHONPATH="$SITE:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
}

part() {  # part NAME SECONDS COMMAND...: one part under its own timeout; a line in the summary
    local name=$1 limit=$2
    shift 2
    if [ -n "$PARTS" ] && [[ ",$PARTS," != *",$name,"* ]]; then return; fi
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local verdict=ok
    [ $rc = 0 ] || verdict="FAILED rc=$rc"
    [ $rc = 124 ] || [ $rc = 137 ] && verdict="TIMED OUT after ${limit}s"
    [ $rc = 77 ] && verdict="skipped" && rc=0
    echo "   $name: $verdict in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    grep -v '^DEBUG' "$OUT/$name.log" | tail -n "${TAIL:-6}" | sed 's/^/   | /' | tee -a "$OUT/summary.txt"
    [ $rc = 0 ] || FAILED=$((FAILED + 1))
}

run() {
    CPU=0 PARTS=""
    while [ $# -gt 0 ]; do
        case $1 in
            --cpu) CPU=1 ;;
            --parts) PARTS=$2; shift ;;
            *) die "unknown option $1 (run [--cpu] [--parts build,env,race,bf16,lora,nccl1,mux,sessions,tests])" ;;
        esac
        shift
    done
    export OUT=${OUT:-$ROOT/build/gpu-check-out}
    mkdir -p "$OUT" "$WORK" && : >"$OUT/summary.txt"
    FAILED=0
    cd "$ROOT" || die "no $ROOT"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false GPU_CHECK_WORK=$WORK
    local t0=$SECONDS
    install >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; die "installing the carried wheels failed"; }
    local check=("$PY" "$ROOT/benchmarks/gpu_check.py") cpu=() model=$WORK/model-gpu
    if [ "$CPU" = 1 ]; then cpu=(--cpu); model=$WORK/model-cpu; fi
    # slow to build: before the timed parts (always, unless the model is there: --parts may leave it out)
    if [ -z "$PARTS" ] || [[ ",$PARTS," == *",build,"* ]] || [ ! -f "$model/config.json" ]; then
        PARTS_SAVED=$PARTS PARTS=""
        part build 45 "${check[@]}" build "$model" "${cpu[@]}"
        PARTS=$PARTS_SAVED
    fi
    part env 15 "${check[@]}" env "${cpu[@]}"
    if [ "$CPU" = 1 ]; then
        part race 75 "${check[@]}" race "$model" --repeats 3 --control 1 --cpu
    else
        part race 75 "${check[@]}" race "$model" --repeats 20 --control 5
    fi
    part bf16 45 "${check[@]}" iteration "$model" --dtype bfloat16 "${cpu[@]}"
    part lora 45 "${check[@]}" iteration "$model" --lora "${cpu[@]}"
    part nccl1 45 "${check[@]}" nccl1 "$model" "${cpu[@]}"
    if [ "$CPU" = 1 ]; then
        TAIL=4 part mux 120 "${check[@]}" mux "$model" --jobs 3 --iterations 1 --cpu
    else
        TAIL=4 part mux 120 "${check[@]}" mux "$model" --jobs 3 --iterations 2
    fi
    if [ "$CPU" = 1 ]; then
        TAIL=3 part sessions 45 "${check[@]}" sessions "$model" --sessions 2 --steps 1 --cpu
    else
        TAIL=3 part sessions 45 "${check[@]}" sessions "$model" --sessions 8 --steps 3
    fi
    part tests 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
    echo "gpu_check: $FAILED part(s) not ok, $((SECONDS - t0))s in all; logs in $OUT" | tee -a "$OUT/summary.txt"
    return "$FAILED"
}

case ${1:-} in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    *) die "usage: bash benchmarks/gpu_check.sh prepare | run [--cpu] [--parts build,env,race,bf16,lora,nccl1,mux,sessions,tests]" ;;
esac
