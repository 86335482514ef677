import sys

from speakerd.cli import main

sys.exit(main())
