#!/usr/bin/env bash
# The qlora binary carries its own SentencePiece and protobuf-lite (CMakeLists.txt: compiled in from the
# PyPI source distribution, linked whole, kept out of the dynamic symbol table): it loads no shared
# sentencepiece, and neither exports nor imports a protobuf symbol, so no protobuf call can bind to
# libtorch_cpu.so's copy (or torch's to ours) whatever the order the libraries load in.
#   bash tests/tools/check_binary_deps.sh build/qlora
set -uo pipefail
bin="$1"
fail=0
check() { if [ "$1" = 0 ]; then echo "PASS $2"; else echo "FAIL $2"; fail=1; fi; }
ldd "$bin" | grep -i -E "sentencepiece|protobuf"; check $((1 - $?)) "$bin loads no shared sentencepiece or protobuf (ldd)"
n=$(nm -D --defined-only "$bin" | grep -c -i protobuf); check "$n" "$bin exports no protobuf symbol ($n)"
n=$(nm -D --undefined-only "$bin" | grep -c -i protobuf); check "$n" "$bin imports no protobuf symbol ($n)"
n=$(nm -C --defined-only "$bin" | grep -c "google::protobuf::MessageLite::ParseFromArray")
check $((n == 0)) "$bin defines protobuf-lite's parser itself ($n)"
exit $fail
