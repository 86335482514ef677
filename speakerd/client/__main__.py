import sys

from speakerd.client.cli import main

sys.exit(main())
