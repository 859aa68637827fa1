#!/usr/bin/env bash
# The main command's build: kvtier in CMake's Release configuration (-O3,
# the project's -Wall -Wextra -Werror) into DIR, with $CC when it is set
# (the test command makes it with GCC and with clang).  scripts/main.sh and
# scripts/test.sh both build through here, so CI builds exactly what the
# main command builds.  Usage: scripts/build-release.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: scripts/build-release.sh DIR}
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$dir" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null
