import sys

from calibrl.cli import main

if __name__ == "__main__":  # a spawned worker process imports this module; only a real run enters the CLI
    sys.exit(main())
