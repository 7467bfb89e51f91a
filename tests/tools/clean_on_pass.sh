#!/bin/sh
# clean_on_pass.sh DIR CMD [ARG...]: runs CMD; when it passes, removes DIR, the test's work directory
# (its models, checkpoints and GGUF files: up to 2.6 GB a test, 9 GB for the whole suite if kept).
# A failing or skipped test keeps DIR to be read; QLORA_KEEP_TEST_OUTPUT=1 keeps every one.
dir=$1
shift
"$@"
rc=$?
if [ "$rc" -eq 0 ] && [ -z "$QLORA_KEEP_TEST_OUTPUT" ]; then
  rm -rf -- "$dir"
fi
exit "$rc"
