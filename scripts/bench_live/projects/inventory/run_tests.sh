#!/bin/sh
# unittest without the wall-clock line, so that a run's output depends on the code only
cd "$(dirname "$0")" && python3 -m unittest discover -s tests -t . "$@" 2>&1 | sed -E 's/^(Ran [0-9]+ tests?) in [0-9.]+s$/\1/'
