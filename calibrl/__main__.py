import sys

from calibrl.cli import main

sys.exit(main())
