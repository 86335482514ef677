"""`python -m speakerd.tools.suite`: see speakerd/tools/suite/cli.py."""

import sys

from speakerd.tools.suite.cli import main

sys.exit(main())
