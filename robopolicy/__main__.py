import sys

from robopolicy.cli import main

sys.exit(main())
