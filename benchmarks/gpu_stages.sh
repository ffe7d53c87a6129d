# Sourced by the one-call GPU scripts (benchmarks/gpu_*_run.sh) from the repository root after
# they set OUT: pipefail, $OUT, unbuffered python, the kernel cache in the carried .kbuild (unless
# QOQTOOL_KERNEL_CACHE says otherwise), a staged log, and the machine / install / library
# stages they share.
set -o pipefail
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 QOQTOOL_KERNEL_CACHE=${QOQTOOL_KERNEL_CACHE:-$PWD/.kbuild}
LOG=$OUT/log.txt
stage() { echo; echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

# The GPU and its clocks, an editable install, the kernel library (a cache hit on a carried
# .kbuild unless the sources changed): $1 = seconds allowed for the build.
setup_machine() {
  stage "machine"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$LOG"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$LOG"
  stage "build (a cache hit unless the sources changed)"
  timeout "$1" python3 -m qoqtool.kernels.build 2>&1 | tail -3 | tee -a "$LOG"
}

# A carried xz file decompressed ($1 -> $2) with python's lzma (the machine need not have xz).
unxz() { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; }

# compute-sanitizer memcheck of the pytest ids after $1 (seconds allowed); its log goes to
# $OUT/${SAN_LOG:-sanitizer}.txt and its exit status to SAN_RC (9 when it found errors).
memcheck() {
  local limit=$1
  shift
  timeout "$limit" compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 10 \
    python3 -m pytest -q -p no:cacheprovider --tb=line "$@" 2>&1 | tee "$OUT/${SAN_LOG:-sanitizer}.txt" | tail -25
  SAN_RC=$?
}
