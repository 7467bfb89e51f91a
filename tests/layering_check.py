"""Folders include each other in one direction only: a source may include headers of its own folder
or of folders listed before it in ORDER, never after. Each folder is one CMake library linking only
the ones before it (CMakeLists.txt), so a violation here is also a cycle the build would hide.
Prints "N passed, M failed"; exit code 1 on any violation.
"""
import os
import re
import sys

ORDER = ["quant", "kernels", "ops", "io", "images", "report", "jinja", "data", "modules", "models", "optim", "checkpoint", "gguf", "engine",
         "train", "config", "recipes", "cli"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"(?:qlora/)?([a-z_]+)/')


def folder_of(root, path):
    rel = os.path.relpath(path, root).split(os.sep)
    if rel[0] == "src" and len(rel) > 2:
        return rel[2]
    return rel[0]


def main():
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    passed = failed = 0
    for top in ("quant", "kernels", "src", "recipes", "cli"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith((".h", ".cpp", ".cu", ".cuh", ".in")):
                    continue
                path = os.path.join(dirpath, name)
                mine = folder_of(root, path)
                if mine not in ORDER:
                    print(f"FAIL {os.path.relpath(path, root)}: folder '{mine}' is not in the layering order")
                    failed += 1
                    continue
                with open(path, encoding="utf-8") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m or m.group(1) not in ORDER:
                            continue
                        if ORDER.index(m.group(1)) > ORDER.index(mine):
                            print(f"FAIL {os.path.relpath(path, root)}:{lineno}: {mine}/ includes {m.group(1)}/, "
                                  f"which comes after it ({' -> '.join(ORDER)})")
                            failed += 1
                        else:
                            passed += 1
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
