#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine: installs what the tests need, then lint, format, types,
# import boundaries and pytest. Extra arguments go to pytest (e.g. scripts/test.sh -k buffer).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh --test
export PATH="$PWD/.venv/bin:/usr/sbin:$PATH"
echo "== ruff check" && ruff check .
echo "== ruff format --check" && ruff format --check .
echo "== mypy" && mypy
echo "== import-linter" && lint-imports
echo "== pytest" && exec python -m pytest "$@"
