#!/usr/bin/env bash
# Usage: check_gloo_object.sh <object files of libkiln...>
# Passes when the object compiled from src/dist/gloo_backend.cpp defines no symbol of namespace
# gloo and no c10d::ProcessGroupGloo code or vtable of its own, and does refer to libtorch's
# ProcessGroupGloo constructor (so the check looked at the right object).
set -euo pipefail
object=""
for o in "$@"; do
  case "$o" in */gloo_backend.cpp.o) object=$o ;; esac
done
[ -n "$object" ] || { echo "FAIL: no gloo_backend.cpp.o among the library's objects"; exit 1; }
defined=$(nm -C --defined-only "$object" | grep -E ' (gloo::|c10d::ProcessGroupGloo::|vtable for c10d::ProcessGroupGloo|vtable for gloo::|typeinfo for gloo::)' || true)
if [ -n "$defined" ]; then
  echo "FAIL: $object defines Gloo code compiled from the system's Gloo headers:"
  echo "$defined"
  exit 1
fi
nm -C --undefined-only "$object" | grep -q 'c10d::ProcessGroupGloo::ProcessGroupGloo(' ||
  { echo "FAIL: $object does not call libtorch's ProcessGroupGloo constructor"; exit 1; }
echo "ok: $object defines no Gloo symbol; it calls libtorch_cpu's ProcessGroupGloo"
