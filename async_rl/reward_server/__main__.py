import sys

from async_rl.reward_server.server import main

if __name__ == "__main__":
    sys.exit(main())
