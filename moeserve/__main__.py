import sys

from moeserve.cli import main

sys.exit(main())
