import sys

from tuneledger.cli import main

sys.exit(main())
