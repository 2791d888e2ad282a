#!/usr/bin/env bash
# The mutation check: mutmut puts small realistic bugs into the critical modules one at a time and runs each
# module's covering tests against them; it prints, per module, the killed share of a seeded sample of mutants
# and every survivor's diff (scripts/mutation.py has the details; docs/reliability.md the last scores).
# Slow (about 40 minutes for the default 30 mutants per module on two shared cores): not part of scripts/test.sh.
#   scripts/mutation.sh                                  # every module, 30 mutants each, seed 28
#   scripts/mutation.sh --module mapper/wire/eventbus.py --sample 200
# Needs mutmut: .venv/bin/pip install -e '.[mutation]'
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/mutation.py "$@"
