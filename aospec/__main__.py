import sys

from aospec.cli import main

sys.exit(main())
