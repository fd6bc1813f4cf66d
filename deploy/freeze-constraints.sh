#!/usr/bin/env bash
# Prints constraints.txt for the virtualenv given (default .venv): its header, then `pip freeze` less pip and
# the editable project itself, with local version labels dropped (torch==2.13.0+cpu -> torch==2.13.0, so the same
# pin takes the CUDA build on a GPU host). Freeze a venv that holds nothing but laya-fleet[dev,fast] and what
# they pull in: deploy/install.sh makes one.
set -euo pipefail
venv="${1:-${VENV:-.venv}}"
cat <<'HEADER'
# Exact versions of everything `pip install ".[dev,fast]"` installs (laya-fleet's dependencies with its dev and
# fast extras, and theirs), as tested together. deploy/install.sh (make setup, deploy/Dockerfile) installs
# through it: pip install -c constraints.txt ... . Local build labels are dropped: torch==2.13.0 is the CPU
# build where the Makefile installs that first, the CUDA build on a GPU host.
#
# Regenerate (after installing new versions into a venv of only these packages, and testing them):
#   deploy/freeze-constraints.sh .venv > constraints.txt.new && mv constraints.txt.new constraints.txt
HEADER
# --all: setuptools is a dependency too (torch's); pip itself is not, install.sh upgrades it
"$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -e '^#' -e '^pip==' \
    | sed -E 's/^([^=]+==[^+]+)\+.*$/\1/'
