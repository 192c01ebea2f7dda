# The environment for building dllm_fast's CUDA kernels against a PyPI CUDA build of torch, whose CUDA headers
# and libraries come as wheels (site-packages/nvidia/...), beside a local CUDA toolkit that may lack cuBLAS and
# cuSPARSE. Source it in bash, then build with DLLM_FAST_CUDA=1:
#
#   source .ci/cuda_env.sh [PYTHON]     # PYTHON: the interpreter whose torch you build against (default: python)
#   DLLM_FAST_CUDA=1 PYTHON -m pip install --no-build-isolation -e .
#
# It exports
#   CUDA_HOME     the toolkit that nvcc belongs to, asked of nvcc itself (a CUDA_HOME already set is kept).
#                 torch otherwise guesses it from nvcc's folder, wrongly when nvcc is a wrapper in /usr/local/bin;
#   CPATH         + every nvidia/*/include of the wheels (cublas_v2.h, cusparse.h, ...). CPATH comes after the
#                 compiler's -I folders, so the toolkit's own headers win and the wheels only fill the gaps;
#   LIBRARY_PATH  + build/cuda-links, remade at each source: a libX.so link to each versioned libX.so.N of the
#                 wheels (they ship libcublas.so.13 but no libcublas.so, which `-lcublas` needs).
# CI uses it in .ci/cuda_build; it is the one place that knows about this layout.

dllm_fast_cuda_env() {
  local python=${1:-python}
  local repo
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

  if [ -z "${CUDA_HOME:-}" ]; then
    if ! command -v nvcc >/dev/null 2>&1; then
      echo "cuda_env.sh: nvcc is not on PATH; install a CUDA toolkit or set CUDA_HOME to one." >&2
      return 1
    fi
    # nvcc's dry run names its own root (TOP=<root>/bin/..) even when the nvcc on PATH is a wrapper script.
    local top
    top=$(nvcc --dryrun -v -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    if [ -z "$top" ]; then
      top="$(dirname "$(readlink -f "$(command -v nvcc)")")/.."
    fi
    CUDA_HOME=$(readlink -f "$top")
    export CUDA_HOME
  fi

  # The wheel folders of the torch that `python` imports: lines "include <dir>" and "lib <dir>".
  local listing
  listing=$("$python" - <<'EOF'
import glob, os, sys
import torch
if torch.version.cuda is None:
    sys.exit(f"cuda_env.sh: torch {torch.__version__} at {os.path.dirname(torch.__file__)} is a CPU build; "
             "install a CUDA build (e.g. torch==2.11.0 from PyPI) into this interpreter's environment.")
try:
    import nvidia
except ImportError:
    sys.exit(0)  # a torch built against a system toolkit: nothing to add
for root in nvidia.__path__:
    for kind in ("include", "lib"):
        for folder in sorted(glob.glob(os.path.join(root, "*", kind))):
            print(kind, folder)
EOF
  ) || return 1

  local links="$repo/build/cuda-links"
  rm -rf "$links" && mkdir -p "$links"
  local kind folder library
  while read -r kind folder; do
    case "$kind" in
      include) CPATH="${CPATH:+$CPATH:}$folder" ;;
      lib)
        for library in "$folder"/lib*.so.[0-9]*; do
          [ -e "$library" ] || continue
          local name
          name=$(basename "$library")
          name="${name%%.so.*}.so"
          [ -e "$folder/$name" ] || [ -e "$links/$name" ] || ln -s "$library" "$links/$name"
        done ;;
    esac
  done <<< "$listing"
  export CPATH
  export LIBRARY_PATH="$links${LIBRARY_PATH:+:$LIBRARY_PATH}"
  echo "cuda_env.sh: CUDA_HOME=$CUDA_HOME CPATH=${CPATH:-} LIBRARY_PATH=$LIBRARY_PATH"
}

dllm_fast_cuda_env "${1:-python}"
dllm_fast_cuda_env_status=$?
unset -f dllm_fast_cuda_env
return "$dllm_fast_cuda_env_status"
