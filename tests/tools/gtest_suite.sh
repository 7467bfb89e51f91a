#!/bin/sh
# gtest_suite.sh BINARY FILTER [cuda]: the GoogleTest cases FILTER selects (a suite's), in one process:
# ctest runs one per suite, not one per case, since each process loads LibTorch first (~0.5 s of CPU).
# Exits 77, which ctest reports as skipped, when none failed and every case skipped itself (GTEST_SKIP),
# or, with "cuda" (a suite's CUDA cases), any did: those cases need a GPU, and where there is none the
# test says so rather than pass. Else the binary's exit code.
out=$("$1" "--gtest_filter=$2" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" -eq 0 ]; then
  if printf '%s\n' "$out" | grep -q '^\[  PASSED  \] 0 tests\.$'; then exit 77; fi
  if [ "${3:-}" = cuda ] && printf '%s\n' "$out" | grep -q '^\[  SKIPPED \] [0-9]* tests\{0,1\}, listed below:$'; then exit 77; fi
fi
exit "$rc"
