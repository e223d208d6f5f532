import sys

from kdn.cli.main import main

sys.exit(main())
