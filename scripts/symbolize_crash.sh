#!/usr/bin/env bash
# Names the frames of a crash report (src/qlora/io/crash_report.h) that glibc printed as
# module(+offset): function, file and line through addr2line (file and line need a build with -g;
# without it, the function still comes from the symbol table). Frames printed with a symbol are
# demangled. Every other line passes through unchanged.
#
#   scripts/symbolize_crash.sh [LOG]      LOG: a file holding the report (default: stdin)
#
# Run it where the crashed binaries are, unchanged since the crash (the offsets are theirs). A
# frame's offset is a return address, so the call before it (offset - 1) is what is looked up;
# except for the signal trampoline (__restore_rt) and the frame it interrupted, whose offset is the
# faulting instruction itself. A module named by a relative path that is not found from here is
# looked up as the report's "executable".
set -euo pipefail
command -v addr2line >/dev/null || { echo "symbolize_crash: addr2line not found (binutils)" >&2; exit 1; }
demangle() { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }

frame=0
exe=""
exact=0  # 1: this frame's offset is an instruction, not a return address (after the trampoline)
lookup() { addr2line -Cfip -e "$1" "$2" 2>/dev/null | tr '\n' ' ' | sed 's/ *$//'; }
while IFS= read -r line || [[ -n $line ]]; do
  if [[ $line =~ executable\ ([^\;]+)\; ]]; then exe=${BASH_REMATCH[1]}; fi
  if [[ $line =~ ^(.+)\((\+0x[0-9a-f]+)\)\[0x[0-9a-f]+\]$ ]]; then
    module=${BASH_REMATCH[1]} offset=${BASH_REMATCH[2]#+}
    [[ ! -f $module && -n $exe && ${module##*/} == "${exe##*/}" ]] && module=$exe
    if [[ -f $module ]]; then
      where=$(lookup "$module" "$offset")
      if [[ $where == __restore_rt* ]]; then
        exact=2
      elif ((exact == 0)); then
        where=$(lookup "$module" "$(printf '0x%x' $((offset - 1)))")
      fi
      ((exact > 0)) && exact=$((exact - 1))
      printf '  #%-3d %s  [%s+%s]\n' "$frame" "${where:-??}" "${module##*/}" "$offset"
    else
      printf '  #%-3d ??  [%s+%s: not found here]\n' "$frame" "$module" "$offset"
    fi
    frame=$((frame + 1))
  elif [[ $line =~ ^(.+)\(([^+\)]+)\+(0x[0-9a-f]+)\)\[0x[0-9a-f]+\]$ ]]; then
    module=${BASH_REMATCH[1]} symbol=${BASH_REMATCH[2]} offset=${BASH_REMATCH[3]}
    printf '  #%-3d %s+%s  [%s]\n' "$frame" "$(demangle <<<"$symbol")" "$offset" "${module##*/}"
    frame=$((frame + 1))
  else
    printf '%s\n' "$line"
  fi
done < "${1:-/dev/stdin}"
